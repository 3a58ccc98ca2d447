//! The lock operations: acquire, renew, renew-batch, release and inspect.
//!
//! Each is a few calls on the shard that owns the name (or that the
//! lockId names), with no per-lock state in the router. Those calls are
//! the shard's lock-level operations ([`Shard`]'s methods: a session got
//! or granted, a grant on it, a check and a keepalive, a release, a place
//! in a queue); this layer names no field of a shard and makes no etcd
//! call of its own. It is the policy over them: which limits and quotas
//! apply, when to retry, how long to wait, and what each outcome answers.
//! What the operations do in etcd:
//! - [`acquire`]: one txn that creates the key on the client's session lease
//!   (with its held record) only if nobody holds the name, no lost holder's
//!   lock-delay is pending, and the shard still records this router's ring
//!   and identity; the session lease is renewed alongside (coalesced).
//!   [`wait`]: the waiting acquire, a FIFO queue per name in etcd.
//!   [`limit`]: each clientId's acquire rate; [`quota`]: each principal's
//!   held locks and sessions, reserved per acquire.
//! - [`renew`]: a coalesced keepalive of the lock's lease plus a batched,
//!   linearizable check that the key still has the lockId's create revision
//!   and lease.
//! - [`extend`]: the lock moved onto its client's session lease of another
//!   TTL by one txn that keeps the key (the same fencing token, a new
//!   lockId), only if the key is still the version read.
//! - [`release`]: a txn deleting the key (and its held record) only if it
//!   still has that create revision and lease, so a stale lockId never
//!   touches a later holder.
//! - [`inspect`]: who holds a name; [`force`]: an operator takes a name
//!   from its holder; [`listing`]: the locks held, page by page, and what
//!   one client holds; [`validate`]: the input rules.
//!
//! The decisions are generic over the shard they run on
//! ([`LockShard`]): `decisions.rs` tests them against an in-memory shard.
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

use crate::config::{Limits, LockDelay};
use crate::metrics::ShardOp;
use crate::placement::topology::{NotServing, Router};
use crate::refusal::{Denied, RateLimited};
use crate::shard::conn::EtcdError;
use crate::shard::keys::{LockValue, Recorded, Stored};
use crate::shard::ops::LockShard;
use crate::shard::{AcquireSlot, Busy, Grantable, Held, Renewal, Shard};
use crate::token::lease_tag::LeaseTag;
use crate::token::lock_id::{LockId, Seal, Sealer};
pub use quota::Quotas;
pub use validate::{LockName, SessionTtl};
mod acquire;
#[cfg(test)]
mod decisions;
mod extend;
mod force;
mod inspect;
mod limit;
pub mod listing;
mod quota;
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
    #[error(transparent)]
    RateLimited(#[from] RateLimited),
    /// The caller's principal may not touch this name or lock.
    #[error(transparent)]
    PermissionDenied(#[from] Denied),
    /// This replica already has its most acquires in flight on the shard
    /// (a slow shard), or in all.
    #[error("shard {shard} is overloaded: {detail}; retry after a second")]
    Overloaded { shard: String, detail: String },
    /// etcd refused a call for another reason than being unavailable (a
    /// bug, or a misconfigured cluster): its error is the source.
    #[error("internal error: {0}")]
    Etcd(#[source] EtcdError),
    /// Something the router found that it never writes (a corrupt value).
    #[error("internal error: {0}")]
    Internal(#[source] Corrupt),
}

/// What the router found in etcd that it never writes there.
#[derive(Debug, thiserror::Error)]
pub enum Corrupt {
    /// A lock key's value is not a lock value; serde's error is the source.
    #[error("unreadable lock value: {0}")]
    LockValue(#[source] serde_json::Error),
    /// A ring epoch that no fencing token can carry.
    #[error("ring epoch {0} out of range")]
    Epoch(u64),
    /// A fencing token that would not fit its bits (epoch, revision).
    #[error("fencing token out of range (epoch {epoch}, revision {revision})")]
    Token { epoch: u64, revision: i64 },
}

impl From<Corrupt> for LockError {
    fn from(c: Corrupt) -> Self {
        Self::Internal(c)
    }
}

impl From<EtcdError> for LockError {
    fn from(e: EtcdError) -> Self {
        match e {
            EtcdError::Unavailable { shard, detail } => {
                LockError::ShardUnavailable { shard, detail }
            }
            other => LockError::Etcd(other),
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
        self.report_at(Instant::now(), SystemTime::now())
    }

    /// The same, off a sample taken once for many answers (a renew-batch),
    /// after the etcd requests that vouch for them were sent.
    pub fn report_at(&self, now: Instant, wall: SystemTime) -> (u64, SystemTime) {
        let left = self.0.saturating_duration_since(now);
        (left.as_millis() as u64, wall + left)
    }

    /// The expiry a renewal vouches for a lock of `lock_ttl` seconds,
    /// counted from no later than `key_seen` (the send of the request that
    /// saw the lock key). Never more than the lock's own TTL, even when
    /// etcd gave its lease a longer one (it raises TTLs below its minimum):
    /// the lock-delay of a lost holder lasts the lock's TTL, and covers
    /// only validity it was told of within that (`docs/design.md`, 7).
    pub fn vouched(renewal: &Renewal, key_seen: Instant, lock_ttl: u32) -> Self {
        let from = renewal.sent_at.min(key_seen);
        let secs = renewal.ttl_secs.clamp(0, i64::from(lock_ttl));
        Self(from + Duration::from_secs(secs as u64))
    }
}

/// An acquire as the caller sent it, before any check.
pub struct AcquireRequest {
    pub name: String,
    pub ttl_ms: u64,
    pub client_id: String,
    pub wait_ms: u64,
    /// A small JSON object or string to record with the lock.
    pub metadata: Option<serde_json::Value>,
    /// When the request arrived: its latency on its shard counts from then.
    pub received: Instant,
}

/// An acquire checked once ([`Active::check_acquire`]): every field holds
/// a value the limits allow, the clientId is scoped to its principal, and
/// the name's shard is looked up. The rest of the acquire reads these and
/// never checks, reshapes or looks them up again.
///
/// `S`, the shard it goes to, is a [`Shard`] but in the decisions' unit
/// tests, which give it an in-memory one.
///
/// The request's own deadline (past it the HTTP layer answers 504) is not
/// copied here: it is the task's ([`crate::task::request_deadline`]), where
/// the shard layer reads it for every etcd call made for the request.
pub(crate) struct Acquire<S = Shard> {
    pub name: LockName,
    /// The shard that owns the name in this generation's ring. Looked up
    /// once, and every retry and every look of a wait goes to it: a
    /// router's ring and shards never change (a new ring is a new router,
    /// made by a reload, and a request keeps the generation it started
    /// on). A migration opened meanwhile is read when it matters (the
    /// handoff from the previous shard, a waiter's check that the name
    /// moved).
    pub shard: Arc<S>,
    /// Of the session lease the lock rides on (`ttlMs` rounded up).
    pub ttl: SessionTtl,
    pub holder: Holder,
    /// Its principal, whose quotas apply.
    pub owner: Option<Owner>,
    /// When a wait in the name's queue gives up (`waitMs` after the
    /// check); `None`: answered at once.
    pub wait_until: Option<Instant>,
    pub metadata: Option<serde_json::Value>,
    pub received: Instant,
}

impl<S> Acquire<S> {
    /// Until when it may wait for the name: for an acquire that does not
    /// wait, when it arrived (not at all).
    pub fn deadline(&self) -> Instant {
        self.wait_until.unwrap_or(self.received)
    }
}

/// On whose behalf a lock operation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller<'a> {
    /// No principals are configured: anyone may do anything.
    Anyone,
    /// This principal: its locks are held under clientIds scoped to it,
    /// and only it may renew or release them.
    Principal { name: &'a str, quota: Quota },
}

/// A principal's bounds on what it holds across the deployment, as this
/// replica's lock-key caches count it (0: no bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    pub max_held_locks: u64,
    /// Session leases holding its locks.
    pub max_sessions: u64,
}

/// The principal an acquire is made for, as quotas need it.
#[derive(Debug, Clone)]
pub struct Owner {
    pub name: String,
    /// In the lease ids of its sessions.
    pub tag: LeaseTag,
    pub quota: Quota,
}

/// The owner `caller` acts as: its principal, if principals are configured.
pub(crate) fn owner_of(caller: Caller<'_>) -> Option<Owner> {
    match caller {
        Caller::Principal { name, quota } => Some(Owner {
            name: name.to_string(),
            tag: LeaseTag::of(name),
            quota,
        }),
        Caller::Anyone => None,
    }
}

/// Between a principal's name and a clientId in a holder: a control
/// character, which no clientId contains, so a scoped holder never equals
/// another principal's or an unscoped one.
const OWNER_SEP: char = '\u{1f}';

/// Who holds a lock: a clientId, scoped to the principal it acts for, so
/// principals never share a holder, a session lease or a waiter's place.
/// Its [`as_str`](Holder::as_str) form is what lock keys, sessions and
/// queue entries record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder(String);

impl Holder {
    /// `client_id` acting for `caller`.
    pub fn new(caller: Caller<'_>, client_id: &str) -> Self {
        Self(match caller {
            Caller::Anyone => client_id.to_string(),
            Caller::Principal { name, .. } => format!("{name}{OWNER_SEP}{client_id}"),
        })
    }

    /// The recorded form.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The clientId the caller sent.
    pub fn client_id(&self) -> &str {
        split_holder(&self.0).1
    }
}

/// A holder split into (principal, clientId); the principal is empty for
/// an unscoped holder.
pub fn split_holder(holder: &str) -> (&str, &str) {
    holder.split_once(OWNER_SEP).unwrap_or(("", holder))
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

/// What an extend came to.
pub enum Extended {
    /// The lock rides on the session lease of its new TTL: its new lockId,
    /// the same fencing token, and the expiry that lease has.
    Moved(Grant),
    /// Not extended, as a renewal would answer: `expired` or `stolen`.
    Refused(RenewOutcome),
}

pub struct Inspection {
    pub shard: String,
    pub holder: Option<(u64, Expiry)>,
    /// The holder's clientId (shown to admin callers only).
    pub client_id: Option<String>,
    /// When the holder was granted it, if recorded.
    pub acquired_at: Option<SystemTime>,
    /// What the holder attached at acquire.
    pub metadata: Option<serde_json::Value>,
    /// Waiting acquires queued for the name on its shard.
    pub waiters: u64,
}

/// The lock a force-release took away.
#[derive(Debug, Clone)]
pub struct Forced {
    pub shard: String,
    pub fencing_token: u64,
    pub client_id: String,
}

/// What a force-release did.
#[derive(Debug, Clone)]
pub enum ForceOutcome {
    /// The grant that held the name was deleted.
    Released(Forced),
    /// Nothing was deleted: nothing held the name (or its holder let go
    /// while the router looked).
    Free,
    /// Nothing was deleted: another grant than the one asked for holds
    /// the name, under this fencing token.
    OtherGrant { fencing_token: u64 },
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
    /// When a renewal sends its session lease a keepalive.
    pub keepalive: KeepalivePolicy,
    /// Renewals slower than this make their shard shed acquires (0: never).
    pub renewal_budget: Duration,
    /// What happens to the name of a holder lost other than by release.
    pub lock_delay: LockDelay,
    /// Issues and opens lockIds (sealed under the configured keys).
    pub sealer: Sealer,
    /// Per-principal quota reservations of this replica (shared by every
    /// generation: acquires in flight across a reload still count).
    pub quotas: Arc<Quotas>,
}

impl Active {
    /// The generation `settings` describe, over `router`, sealing lockIds
    /// with `sealer`; `quotas` carries the reservations of the generation
    /// it replaces (a new one at start). Start and reload both build it
    /// here, so a setting cannot take effect on one and not the other.
    pub fn new(
        settings: &crate::config::Settings,
        router: Arc<Router>,
        sealer: Sealer,
        quotas: Arc<Quotas>,
    ) -> Self {
        Self {
            router,
            limits: settings.limits.clone(),
            keepalive: KeepalivePolicy::of(&settings.etcd),
            renewal_budget: settings.server.renewal_budget(),
            lock_delay: settings.locks.lock_delay,
            sealer,
            quotas,
        }
    }
}

/// When a renewal (or an acquire, or a waiter's upkeep) sends its session
/// lease a keepalive: only when less than `below_pct` percent of the lease's
/// TTL is known to be left, or, at 100, whenever the last keepalive was
/// confirmed more than the coalescing window ago. In between, the renewal
/// is answered with the time the lease has by its last confirmed keepalive
/// (`docs/design.md`, "Keepalives only when a lease needs one").
#[derive(Debug, Clone, Copy)]
pub struct KeepalivePolicy {
    /// Renewals closer together than this always share a keepalive
    /// (capped at a tenth of the TTL).
    pub coalesce: Duration,
    /// 40 to 100.
    pub below_pct: u8,
}

impl KeepalivePolicy {
    pub fn of(etcd: &crate::config::EtcdSettings) -> Self {
        Self {
            coalesce: etcd.keepalive_coalesce(),
            below_pct: etcd.keepalive_below_pct,
        }
    }

    /// How long after a lease's last confirmed keepalive was sent a renewal
    /// still sends none: until `below_pct` of its TTL is left, and never
    /// less than the coalescing window.
    pub fn window(&self, ttl_secs: u32) -> Duration {
        let ttl_ms = u64::from(ttl_secs) * 1_000;
        let spent = ttl_ms * u64::from(100 - self.below_pct.min(100)) / 100;
        self.coalescing(ttl_secs).max(Duration::from_millis(spent))
    }

    /// Renewals this close always share a keepalive: the coalescing
    /// window, capped at a tenth of the TTL.
    pub fn coalescing(&self, ttl_secs: u32) -> Duration {
        self.coalesce
            .min(Duration::from_millis(u64::from(ttl_secs) * 100))
    }
}

/// The lock operations of one generation: its [`Active`] part within the
/// bounds the process sized at start. A request works on one `Locks`
/// throughout, so a reload never changes the ground under it.
pub struct Locks {
    active: Arc<Active>,
    /// Shared by every generation of the process.
    bounds: Arc<StartBounds>,
}

/// What the lock operations bound for the process's whole life: sized at
/// start, kept across reloads.
struct StartBounds {
    /// Caps concurrent waiting acquires.
    waiting: WaitSlots,
    /// Acquires per clientId and second; `None`: no limit.
    per_client: Option<limit::ClientLimiter>,
    /// Most acquires in flight on one shard, when the ring has several.
    per_shard: usize,
}

impl Locks {
    /// The first generation's. `per_shard`: the most acquires this replica
    /// keeps in flight on one shard of a ring with several (a slow shard
    /// then answers 503 `overloaded` for its own names and leaves the rest
    /// of the replica's capacity to the others); the bounds on waiters and
    /// on each clientId's rate are `active`'s limits.
    pub fn new(active: Active, per_shard: usize) -> Self {
        let bounds = StartBounds {
            waiting: WaitSlots::new(active.limits.max_waiters),
            per_client: limit::ClientLimiter::new(active.limits.acquires_per_client_per_sec),
            per_shard: per_shard.max(1),
        };
        Self {
            active: Arc::new(active),
            bounds: Arc::new(bounds),
        }
    }

    /// The next generation's, over `active`, within the same bounds.
    pub fn next(&self, active: Active) -> Self {
        Self {
            active: Arc::new(active),
            bounds: self.bounds.clone(),
        }
    }

    pub fn active(&self) -> &Arc<Active> {
        &self.active
    }

    /// Acquires `req.name` for `req.client_id`, acting for `caller`.
    pub async fn acquire(
        &self,
        req: AcquireRequest,
        caller: Caller<'_>,
    ) -> Result<Acquired, LockError> {
        let active = &self.active;
        let req = &active.check_acquire(req, caller)?;
        let limited = match &self.bounds.per_client {
            Some(limiter) => limiter
                .check(req.holder.as_str())
                .map_err(|wait| RateLimited {
                    reason: format!(
                        "clientId {:?} is past {} acquires/s; retry in {} ms",
                        req.holder.client_id(),
                        limiter.per_sec(),
                        wait.as_millis().max(1)
                    ),
                    retry_after: wait.max(Duration::from_secs(1)),
                })
                .map_err(LockError::from),
            None => Ok(()),
        };
        let shard = &req.shard;
        let latency = shard.metrics().latency(ShardOp::Acquire, req.received);
        let slot = match limited {
            Ok(()) => self.shard_slot(active, shard),
            Err(e) => Err(e),
        };
        let result = match slot {
            Err(e) => Err(e),
            Ok(_slot) if req.wait_until.is_none() => active.acquire_now(req).await,
            Ok(_slot) => active.acquire_waiting(req, &self.bounds.waiting).await,
        };
        let outcome = match &result {
            Ok(Acquired::Granted(_)) => "acquired",
            Ok(Acquired::Held(_)) => "not_acquired",
            Err(LockError::ShardUnavailable { .. }) => "shard_unavailable",
            Err(LockError::RateLimited { .. }) => "rate_limited",
            Err(LockError::Overloaded { .. }) => "overloaded",
            Err(LockError::Internal(_) | LockError::Etcd(_)) => "error",
            // No shard to speak of.
            Err(LockError::InvalidArgument(_) | LockError::PermissionDenied(_)) => {
                latency.discard();
                return result;
            }
        };
        shard.metrics().acquire(outcome);
        result
    }

    /// A slot among the acquires in flight on `shard`, bounded when the
    /// ring has several shards.
    fn shard_slot<'a>(
        &self,
        active: &Active,
        shard: &'a Shard,
    ) -> Result<AcquireSlot<'a>, LockError> {
        let bound = if active.router.shards.len() > 1 {
            self.bounds.per_shard
        } else {
            usize::MAX
        };
        let detail = match shard.admit_acquire(bound, Instant::now()) {
            Ok(slot) => return Ok(slot),
            Err(Busy::Shedding) => "its renewals are slow, and renewals come first".into(),
            Err(Busy::Full(in_flight)) => {
                format!("{in_flight} acquires in flight through this router, its limit")
            }
        };
        Err(LockError::Overloaded {
            shard: shard.name().to_string(),
            detail,
        })
    }

    /// Renews one lock; `received`: when the request arrived (its latency
    /// on the lock's shard counts from then).
    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<RenewOutcome, LockError> {
        self.active
            .renew(lock_id, token, ttl_ms, caller, received)
            .await
    }

    /// Renews every lock in `locks`; `received` as for [`Locks::renew`].
    pub async fn renew_batch(
        &self,
        locks: &[(&str, u64)],
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<Vec<RenewOutcome>, LockError> {
        self.active.renew_batch(locks, caller, received).await
    }

    /// Extends one lock to a new TTL ([`Active::extend`]); `received` as
    /// for [`Locks::renew`].
    pub async fn extend(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: u64,
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<Extended, LockError> {
        (self.active)
            .extend(lock_id, token, ttl_ms, caller, received)
            .await
    }

    pub async fn release(
        &self,
        lock_id: &str,
        token: u64,
        caller: Caller<'_>,
    ) -> Result<(), LockError> {
        self.active.release(lock_id, token, caller).await
    }

    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        self.active.inspect(name).await
    }

    /// Takes `name` from its holder; with `only`, only from the grant with
    /// that fencing token.
    pub async fn force_release(
        &self,
        name: &str,
        only: Option<u64>,
    ) -> Result<ForceOutcome, LockError> {
        self.active.force_release(name, only).await
    }
}

impl Active {
    /// The TTL of a lock asked for `ttl_ms` under this config.
    pub(crate) fn ttl(&self, ttl_ms: u64) -> Result<SessionTtl, LockError> {
        Ok(SessionTtl::parse(ttl_ms, &self.limits)?)
    }

    /// `name`, if it is a lock name under this config.
    pub(crate) fn lock_name(&self, name: String) -> Result<LockName, LockError> {
        Ok(LockName::parse(name, &self.limits)?)
    }

    /// A renewal or an acquire on a lease of `ttl_secs` confirmed less
    /// than this ago sends no keepalive ([`KeepalivePolicy::window`]).
    pub(crate) fn window(&self, ttl_secs: u32) -> Duration {
        self.keepalive.window(ttl_secs)
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
        crate::task::name_shard(id.shard.as_str());
        self.router.shard_named(&id.shard).ok_or_else(|| LockError::ShardUnavailable {
            shard: id.shard.to_string(),
            detail: "this router does not know the shard (not reloaded yet, or the shard was removed)".into(),
        })
    }
}

/// The record a lock key holds, and the fencing token of its grant.
pub(crate) fn held_by(kv: &Stored) -> Result<(LockValue, u64), LockError> {
    let value: LockValue = serde_json::from_slice(kv.value()).map_err(Corrupt::LockValue)?;
    let revision = kv.create_revision();
    let token = crate::token::fencing::token(value.epoch, revision).ok_or(Corrupt::Token {
        epoch: value.epoch,
        revision,
    })?;
    Ok((value, token))
}

/// When the lease of `kv` ends, as far as the router knows now.
pub(crate) async fn lease_end<S: LockShard>(shard: &S, kv: &Stored) -> Result<Expiry, EtcdError> {
    let sent = Instant::now();
    let left = shard.time_to_live(kv.lease()).await?;
    Ok(Expiry(sent + Duration::from_secs(left as u64)))
}

/// The lock key's value for a grant under `ring`.
pub(crate) fn lock_value<S>(req: &Acquire<S>, ring: &Recorded) -> Result<LockValue, LockError> {
    epoch_of(ring)?;
    let at = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(LockValue {
        client: req.holder.as_str().to_string(),
        epoch: ring.meta.epoch,
        name: req.name.as_str().to_string(),
        ttl: req.ttl.secs(),
        at,
        meta: req.metadata.clone(),
    })
}

pub(crate) fn epoch_of(ring: &Recorded) -> Result<u16, LockError> {
    u16::try_from(ring.meta.epoch).map_err(|_| Corrupt::Epoch(ring.meta.epoch).into())
}

impl Active {
    /// The answer to a grant (or re-acquire) to `holder`, confirmed by a txn
    /// sent at `sent`; the lockId names the holder's principal.
    pub(crate) fn grant(
        &self,
        mut lock: LockId,
        holder: &str,
        renewal: &Renewal,
        sent: Instant,
    ) -> Result<Grant, LockError> {
        let fencing_token = lock.token().ok_or(Corrupt::Token {
            epoch: lock.epoch.into(),
            revision: lock.revision,
        })?;
        lock.owner = split_holder(holder).0.into();
        Ok(Grant {
            lock_id: self.sealer.seal(&lock),
            fencing_token,
            expires: Expiry::vouched(renewal, sent, lock.ttl_secs),
        })
    }

    /// The grant a lockId and token name, if this deployment issued it to
    /// `caller`. Counts the key that opened it (see [`crate::metrics`]).
    fn open(&self, lock_id: &str, token: u64, caller: Caller<'_>) -> Result<LockId, LockError> {
        let (id, seal) = self.open_uncounted(lock_id, token, caller)?;
        crate::metrics::lock_ids_opened(seal_label(seal), 1);
        Ok(id)
    }

    /// [`Active::open`] without counting (batches count once per key).
    fn open_uncounted<'s>(
        &'s self,
        lock_id: &str,
        token: u64,
        caller: Caller<'_>,
    ) -> Result<(LockId, Seal<'s>), LockError> {
        let (id, seal) = self
            .sealer
            .open(lock_id)
            .map_err(|e| invalid(e.to_string()))?;
        if id.token() != Some(token) {
            return Err(invalid("fencingToken does not belong to this lockId"));
        }
        if let Caller::Principal { name, .. } = caller {
            // The owner a lockId names, and the lease its lock rides on:
            // every session lease of a principal carries its tag, so an
            // unsealed lockId edited to name another principal's lease is
            // refused here, before it can renew or release anything.
            if id.owner != name || LeaseTag::in_lease(id.lease) != LeaseTag::of(name) {
                return Err(Denied::new("this lock belongs to another principal").into());
            }
        }
        Ok((id, seal))
    }
}

impl Active {
    /// What `tag` holds on `shard` (where an acquire grants) and on every
    /// other shard of this router (the previous ring's included), as the
    /// lock-key caches count it now; `None` while a cache cannot say
    /// (loading, or its watch broke).
    fn held_by<S: LockShard>(&self, shard: &S, tag: LeaseTag) -> Option<Held> {
        let all = self.router.all_shards();
        let mut others = all.iter().filter(|s| s.name() != shard.name());
        others.try_fold(shard.held_by(tag)?, |total, s| {
            let h = s.held_by(tag)?;
            Some(Held {
                locks: total.locks + h.locks,
                sessions: total.sessions + h.sessions,
            })
        })
    }

    /// Reserves a new lock in `owner`'s quota (see [`quota`]); `None`
    /// when it has none. Refused (403) at its `max_held_locks`.
    pub(crate) fn reserve_lock<S: LockShard>(
        &self,
        shard: &S,
        owner: Option<&Owner>,
    ) -> Result<Option<quota::Reservation>, LockError> {
        let Some(o) = owner.filter(|o| o.quota.max_held_locks + o.quota.max_sessions > 0) else {
            return Ok(None);
        };
        let bounds = quota::Bounds {
            tag: o.tag,
            max_locks: o.quota.max_held_locks,
            max_sessions: o.quota.max_sessions,
        };
        self.quotas
            .reserve_lock(bounds, || self.held_by(shard, o.tag))
            .map(Some)
            .map_err(|r| refused(o, r))
    }

    /// Admits a new session lease for an acquire of `owner`'s (the hook of
    /// [`Shard::session`]): reserves it in the owner's `max_sessions` first
    /// (refused at it).
    pub(crate) fn admit_session<S: LockShard>(
        &self,
        shard: &S,
        owner: Option<&Owner>,
        reservation: Option<&quota::Reservation>,
    ) -> Result<(), LockError> {
        if let (Some(r), Some(o)) = (reservation, owner) {
            r.add_session(|| self.held_by(shard, o.tag))
                .map_err(|r| refused(o, r))?;
        }
        Ok(())
    }
}

fn refused(owner: &Owner, r: quota::Refused) -> LockError {
    let what = match r.quota {
        "max_held_locks" => "locks",
        _ => "sessions holding locks",
    };
    let now = if r.reserved > 0 {
        format!(
            "holds {} {what} and has {} more being acquired",
            r.counted, r.reserved
        )
    } else {
        format!("holds {} {what}", r.counted)
    };
    quota_refused(owner, r.quota, now)
}

fn quota_refused(owner: &Owner, quota: &'static str, now: String) -> LockError {
    crate::metrics::quota_refusal(&owner.name, quota);
    Denied(format!(
        "principal {:?} {now}, its {quota}: release some locks first",
        owner.name
    ))
    .into()
}

/// The `key` label of a lockId's seal.
pub(crate) fn seal_label(seal: Seal<'_>) -> &str {
    match seal {
        Seal::Key(id) => id,
        Seal::Unsigned => "unsigned",
    }
}

pub(crate) fn check_up(shard: &Shard) -> Result<(), LockError> {
    if shard.is_up() {
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

pub(crate) fn unavailable<S: LockShard>(shard: &S, detail: &str) -> LockError {
    LockError::ShardUnavailable {
        shard: shard.name().to_string(),
        detail: detail.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_scoped_to_their_principal_and_keep_the_client_id() {
        let quota = Quota::default();
        let pay = Caller::Principal { name: "pay", quota };
        let ship = Caller::Principal {
            name: "ship",
            quota,
        };
        let scoped = Holder::new(pay, "worker-7");
        assert_eq!(scoped.client_id(), "worker-7");
        assert_eq!(split_holder(scoped.as_str()), ("pay", "worker-7"));
        // One clientId under two principals, or none, is three holders.
        assert_ne!(scoped, Holder::new(ship, "worker-7"));
        assert_ne!(scoped, Holder::new(Caller::Anyone, "worker-7"));
        let anyone = Holder::new(Caller::Anyone, "worker-7");
        assert_eq!(
            (anyone.as_str(), anyone.client_id()),
            ("worker-7", "worker-7")
        );
    }

    #[test]
    fn a_keepalive_is_due_once_less_than_the_share_of_the_ttl_is_left() {
        let policy = |below_pct| KeepalivePolicy {
            coalesce: Duration::from_secs(1),
            below_pct,
        };
        // Half of a 30 s TTL spent: 15 s without a keepalive.
        assert_eq!(policy(50).window(30), Duration::from_secs(15));
        assert_eq!(policy(40).window(30), Duration::from_secs(18));
        // At 100 every renewal past the coalescing window sends one, the
        // window capped at a tenth of the TTL.
        assert_eq!(policy(100).window(30), Duration::from_secs(1));
        assert_eq!(policy(100).window(5), Duration::from_millis(500));
        // Never less than the coalescing window.
        let wide = KeepalivePolicy {
            coalesce: Duration::from_secs(2),
            below_pct: 95,
        };
        assert_eq!(wide.window(30), Duration::from_secs(2));
    }
}
