//! A held lock: its identity (name, lockId, fencing token), its validity as
//! the client's own clock judges it, and the "lost" signal.
//!
//! State lives in a `watch` channel shared by every [`Lock`] of one grant
//! (one per acquire of a name the client already holds; see `registry`),
//! their [`LockHandle`]s and the client's renewal task: the task moves
//! `valid_until` forward on each confirmed renewal and records why a lock
//! was lost; readers also compare `valid_until` with the clock themselves,
//! so a lock is lost on time even if the renewal task is starved or the
//! router is unreachable. Releasing or dropping any `Lock` of a grant marks
//! them all lost at once, and the grant is released at the router once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

use crate::client::Client;
use crate::error::{Error, LostReason};
use crate::release::{self, Until};
use crate::renewal::Command;
use crate::transport::LockRef;

/// Validity as last confirmed, why the lock was lost once it is, and where
/// its release stands.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Status {
    pub valid_until: Instant,
    pub lost: Option<LostReason>,
    pub release: Release,
}

/// Where a grant's release at the router stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    NotStarted,
    /// Under way, in [`Lock::release`] or in the renewal task.
    Pending,
    /// The router answered 204.
    Done,
    /// The router refused it (a 4xx other than 429): retrying cannot help.
    GaveUp,
}

/// What every view of one grant shares.
pub(crate) struct Shared {
    /// Identifies the lock within its client's renewal task.
    pub key: u64,
    pub name: String,
    pub lock_ref: LockRef,
    pub ttl: Duration,
    pub margin: Duration,
    pub status: watch::Sender<Status>,
    /// Wakes a pending release from its backoff: an acquire that raced the
    /// release wants it settled now.
    pub retry_now: Notify,
    /// Where the client keeps its grants, so that this state can leave it
    /// when it goes.
    kept_in: Arc<dyn Forget>,
}

/// Where a client keeps the state of each grant it holds (its registry),
/// told when a state goes so that its entry goes too. A trait, so that the
/// state does not depend on the registry that holds it.
pub(crate) trait Forget: Send + Sync {
    /// The state of the grant `lock_id` is being dropped; `released`: the
    /// router confirmed its release.
    fn forget(&self, lock_id: &str, released: bool);
}

impl Drop for Shared {
    fn drop(&mut self) {
        let released = self.current().release == Release::Done;
        self.kept_in.forget(&self.lock_ref.lock_id, released);
    }
}

impl Shared {
    pub fn new(
        key: u64,
        name: &str,
        lock_ref: LockRef,
        ttl: Duration,
        margin: Duration,
        valid_until: Instant,
        kept_in: Arc<dyn Forget>,
    ) -> Arc<Self> {
        let (status, _) = watch::channel(Status {
            valid_until,
            lost: None,
            release: Release::NotStarted,
        });
        Arc::new(Self {
            key,
            name: name.to_string(),
            lock_ref,
            ttl,
            margin,
            status,
            retry_now: Notify::new(),
            kept_in,
        })
    }

    /// Marks the lock lost (`Released`, unless it was lost already) and its
    /// release pending; true for the one call that started the release
    /// (only [`Registry::begin_release`] calls this).
    pub fn begin_release(&self) -> bool {
        let mut started = false;
        self.status.send_if_modified(|s| {
            let lost = s.lost.is_none();
            s.lost.get_or_insert(LostReason::Released);
            if s.release == Release::NotStarted {
                s.release = Release::Pending;
                started = true;
            }
            lost || started
        });
        started
    }

    /// Records how the release ended. A 204 counts whoever got it.
    pub fn end_release(&self, outcome: Release) {
        self.status.send_if_modified(|s| {
            let change =
                s.release != outcome && (outcome == Release::Done || s.release == Release::Pending);
            if change {
                s.release = outcome;
            }
            change
        });
    }

    /// Records that the lock is lost; the first reason wins.
    pub fn mark_lost(&self, reason: LostReason) -> bool {
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            s.lost = Some(reason);
            true
        })
    }

    /// Moves validity forward (never back) after a confirmed renewal. A lock
    /// already lost stays lost: a late answer cannot revive it.
    pub fn confirm(&self, valid_until: Instant) {
        let now = Instant::now();
        self.status.send_if_modified(|s| {
            if s.lost.is_some() {
                return false;
            }
            if now >= s.valid_until {
                // Validity ran out before this answer arrived: the lock
                // already counted as lost, even if nobody looked.
                s.lost = Some(LostReason::Unconfirmed);
                return true;
            }
            if valid_until <= s.valid_until {
                return false;
            }
            s.valid_until = valid_until;
            true
        });
    }

    pub fn current(&self) -> Status {
        *self.status.borrow()
    }

    /// Lost by a recorded reason, or by the clock.
    pub fn lost_now(&self) -> Option<LostReason> {
        let s = self.current();
        match s.lost {
            Some(r) => Some(r),
            None if Instant::now() >= s.valid_until => {
                self.mark_lost(LostReason::Unconfirmed);
                self.current().lost
            }
            None => None,
        }
    }
}

/// A lock held through a [`Client`]. The client's background task renews it
/// until it is released or lost.
///
/// Dropping a `Lock` releases it: the drop never blocks, it hands the
/// release to the client's background task, which retries it as
/// [`release`](Self::release) does and then, more slowly, for as long as
/// the client lives. Call [`release`](Self::release) to know when it
/// happened.
///
/// Acquiring a name this client already holds returns another `Lock` for
/// the same grant. Such `Lock`s are one lock: they share validity and the
/// lost signal, are renewed once, and releasing or dropping any of them
/// releases the grant and marks all of them lost
/// ([`LostReason::Released`]) at once.
///
/// ```no_run
/// # async fn demo() -> Result<(), lockrouter_client::Error> {
/// use std::time::Duration;
/// let client = lockrouter_client::Client::new("http://127.0.0.1:8080", None)?;
/// if let Some(lock) = client.acquire("process_order:42", Duration::from_secs(30)).await? {
///     println!("holding {} with token {}", lock.name(), lock.fencing_token());
///     // ... write to the resource, passing lock.fencing_token() ...
///     lock.release().await?;
/// }
/// # Ok(()) }
/// ```
pub struct Lock {
    handle: LockHandle,
    client: Client,
    /// Set once `release` took over, so the drop does nothing more.
    released: bool,
}

/// A cloneable, read-only view of a [`Lock`]: identity, validity and the
/// lost signal. Holding one does not keep the lock: the lock is released
/// when a [`Lock`] of its grant is released or dropped.
#[derive(Clone)]
pub struct LockHandle {
    shared: Arc<Shared>,
}

impl Lock {
    pub(crate) fn new(shared: Arc<Shared>, client: Client) -> Self {
        Self {
            handle: LockHandle { shared },
            client,
            released: false,
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        self.handle.name()
    }

    /// The fencing token of this grant: larger than every earlier grant's
    /// of the same name. Send it with every write to the protected resource
    /// (see [`fencing`](crate::fencing)).
    pub fn fencing_token(&self) -> u64 {
        self.handle.fencing_token()
    }

    /// The router's opaque id of this grant.
    pub fn lock_id(&self) -> &str {
        self.handle.lock_id()
    }

    /// The TTL the lock was acquired with.
    pub fn ttl(&self) -> Duration {
        self.handle.ttl()
    }

    /// True while the client can prove the lock is held: not lost, and its
    /// validity (by this process's monotonic clock) has not run out. A
    /// process can pause right after this returns true; only the resource's
    /// fencing check is safe against that.
    pub fn is_held(&self) -> bool {
        self.handle.is_held()
    }

    /// Time left before validity runs out, as of the last confirmed renewal
    /// (zero once lost).
    pub fn time_left(&self) -> Duration {
        self.handle.time_left()
    }

    /// Resolves once the lock can no longer be trusted, with the reason:
    /// the router said it expired or was taken, the client's clock passed
    /// its validity without a confirmed renewal, or it was released. The
    /// future owns what it needs (`'static`), so it can be spawned or
    /// raced against work with `tokio::select!`.
    ///
    /// ```no_run
    /// # async fn demo(lock: lockrouter_client::Lock) {
    /// tokio::select! {
    ///     reason = lock.lost() => eprintln!("stop: lock lost ({reason})"),
    ///     _ = async { /* the work */ } => {}
    /// }
    /// # }
    /// ```
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.handle.lost()
    }

    /// A cloneable view of this lock to hand to other tasks.
    pub fn handle(&self) -> LockHandle {
        self.handle.clone()
    }

    /// Stops renewing and releases the lock at the router. The lock counts
    /// as lost ([`LostReason::Released`]) from the start, here and in every
    /// other `Lock` of the same grant.
    ///
    /// `Ok` comes only after the router confirmed: the name is then not
    /// held under this lock's id. Transport errors, 429 and 5xx answers
    /// (503 `shard_unavailable`) are retried with backoff while the lock's
    /// validity lasts, so this can take that long; any other error ends it
    /// at once. If validity runs out first, the error is returned and the
    /// client's background task keeps retrying, more slowly, for as long as
    /// the client lives: the lock shares a session lease with this client's
    /// other locks of its TTL on its shard, so while those are renewed it
    /// does not expire on its own. Cancelling this call hands the release
    /// to the background task too.
    ///
    /// If the lock was lost and this client has since acquired the same
    /// grant again through a newer `Lock`, the grant is that `Lock`'s: this
    /// call leaves it alone and returns [`Error::Lost`].
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        let shared = self.handle.shared.clone();
        let inner = self.client.inner.clone();
        let Some(owner) = inner.registry.begin_release(&shared) else {
            return Err(Error::Lost {
                name: shared.name.clone(),
                reason: shared.current().lost.unwrap_or(LostReason::Released),
            });
        };
        if owner {
            let _ = inner.commands.send(Command::Forget { key: shared.key });
        }
        // Whoever started the release delivers it; another `Lock` of the
        // grant may release it as well (the router's release is
        // idempotent), but leaves the background to the owner.
        let mut handoff = HandOff {
            shared: owner.then(|| shared.clone()),
            commands: &inner.commands,
            failures: 0,
        };
        let attempt = || {
            inner
                .transport
                .release(&shared.lock_ref, inner.request_timeout)
        };
        let result =
            release::retry(&shared, attempt, &mut handoff.failures, Until::ValidityEnds).await;
        if !matches!(&result, Err(e) if e.is_retryable()) {
            handoff.shared = None;
        }
        result
    }
}

/// A release [`Lock::release`] started and did not finish (validity ran
/// out, or the call was cancelled): on drop, the renewal task takes it over.
struct HandOff<'a> {
    shared: Option<Arc<Shared>>,
    commands: &'a mpsc::UnboundedSender<Command>,
    /// Attempts made so far, so the task continues the backoff.
    failures: u32,
}

impl Drop for HandOff<'_> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let _ = self.commands.send(Command::Release {
                shared,
                failures: self.failures,
            });
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let shared = &self.handle.shared;
        let inner = &self.client.inner;
        if inner.registry.begin_release(shared) == Some(true) {
            // Unbounded send never blocks; if the task is gone (runtime
            // shutting down) so is this process's hold on the session.
            let _ = inner.commands.send(Command::Release {
                shared: shared.clone(),
                failures: 0,
            });
        }
    }
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl LockHandle {
    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The grant's fencing token; see [`Lock::fencing_token`].
    pub fn fencing_token(&self) -> u64 {
        self.shared.lock_ref.fencing_token
    }

    /// The router's opaque id of this grant.
    pub fn lock_id(&self) -> &str {
        &self.shared.lock_ref.lock_id
    }

    /// The TTL the lock was acquired with.
    pub fn ttl(&self) -> Duration {
        self.shared.ttl
    }

    /// See [`Lock::is_held`].
    pub fn is_held(&self) -> bool {
        self.shared.lost_now().is_none()
    }

    /// See [`Lock::time_left`].
    pub fn time_left(&self) -> Duration {
        match self.shared.lost_now() {
            Some(_) => Duration::ZERO,
            None => self
                .shared
                .current()
                .valid_until
                .saturating_duration_since(Instant::now()),
        }
    }

    /// See [`Lock::lost`].
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        let shared = self.shared.clone();
        let mut rx = shared.status.subscribe();
        async move {
            loop {
                let status = *rx.borrow_and_update();
                if let Some(reason) = status.lost {
                    return reason;
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(status.valid_until) => {
                        if let Some(reason) = shared.lost_now() {
                            return reason;
                        }
                    }
                    // The sender lives in `shared`, which this future owns,
                    // so `changed` cannot fail while we wait.
                    _ = rx.changed() => {}
                }
            }
        }
    }
}

impl std::fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.current();
        f.debug_struct("Lock")
            .field("name", &self.shared.name)
            .field("fencing_token", &self.shared.lock_ref.fencing_token)
            .field("lost", &s.lost)
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::registry::Registry;

    /// State for a grant made in `registry` (not yet its entry).
    pub(crate) fn shared_in(
        registry: &Arc<Registry>,
        key: u64,
        ttl: Duration,
        valid_for: Duration,
    ) -> Arc<Shared> {
        Shared::new(
            key,
            &format!("lock-{key}"),
            LockRef {
                lock_id: format!("id-{key}"),
                fencing_token: key + 1,
            },
            ttl,
            Duration::from_millis(100),
            Instant::now() + valid_for,
            registry.clone(),
        )
    }

    /// State for a grant not in any registry (nobody can release it).
    pub(crate) fn shared(key: u64, ttl: Duration, valid_for: Duration) -> Arc<Shared> {
        shared_in(&Arc::new(Registry::default()), key, ttl, valid_for)
    }

    /// State for a grant that is its registry's entry.
    pub(crate) fn registered(key: u64, ttl: Duration, valid_for: Duration) -> Arc<Shared> {
        let registry = Arc::new(Registry::default());
        let until = Instant::now() + valid_for;
        match registry.claim(&format!("id-{key}"), until, || {
            shared_in(&registry, key, ttl, valid_for)
        }) {
            crate::registry::Claim::New(s) => s,
            _ => unreachable!("an empty registry"),
        }
    }

    fn handle(valid_for: Duration) -> LockHandle {
        LockHandle {
            shared: shared(1, Duration::from_secs(30), valid_for),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn lost_fires_when_validity_runs_out_and_not_before() {
        let h = handle(Duration::from_secs(10));
        let start = Instant::now();
        tokio::time::sleep(Duration::from_millis(9_999)).await;
        assert!(h.is_held());
        assert_eq!(h.lost().await, LostReason::Unconfirmed);
        assert_eq!(Instant::now() - start, Duration::from_secs(10));
        assert!(!h.is_held());
        assert_eq!(h.time_left(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirmed_renewal_moves_validity_forward_never_back() {
        let h = handle(Duration::from_secs(10));
        let start = Instant::now();
        let shared = h.shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            shared.confirm(Instant::now() + Duration::from_secs(10));
            // An older, shorter answer arriving later changes nothing.
            shared.confirm(Instant::now() + Duration::from_secs(1));
        });
        assert_eq!(h.lost().await, LostReason::Unconfirmed);
        assert_eq!(Instant::now() - start, Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_confirmation_cannot_revive_a_lost_lock() {
        let h = handle(Duration::from_secs(10));
        // Nobody looks while validity runs out (as in a paused process).
        tokio::time::sleep(Duration::from_secs(11)).await;
        h.shared.confirm(Instant::now() + Duration::from_secs(10));
        assert!(!h.is_held());
        assert_eq!(h.lost().await, LostReason::Unconfirmed);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_is_lost_at_once_and_the_first_reason_stays() {
        let h = handle(Duration::from_secs(10));
        let start = Instant::now();
        h.shared.mark_lost(LostReason::Stolen);
        h.shared.mark_lost(LostReason::Released);
        assert_eq!(h.lost().await, LostReason::Stolen);
        assert_eq!(Instant::now(), start);
    }
}
