//! A held lock: its identity (name, lockId, fencing token), its validity as
//! the client's own clock judges it, and the "lost" signal, all read from
//! the grant's shared state (`state`), which every [`Lock`] of one grant
//! and their [`LockHandle`]s share with the client's renewal task. A grant
//! has more than one `Lock` only through re-entrant acquires; each is a
//! counted hold, and the grant is released at the router once, with the
//! last.
//!
//! A `Lock` reaches its client only through the client's `Keeper`
//! (transport, renewal channel, registry), never the `Client` itself; it
//! uses the state, `release` and the renewal task's commands below it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::{Error, LostReason};
use crate::holds::LetGo;
use crate::keeper::Keeper;
use crate::release::{self, Tries, Until};
use crate::renewal::Command;
use crate::state::Shared;
use crate::validity;

/// A lock held through a [`Client`](crate::Client). The client's background
/// task renews it until it is released or lost.
///
/// Dropping a `Lock` releases it: the drop never blocks, it hands the
/// release to the client's background task, which retries it as
/// [`release`](Self::release) does and then, more slowly, for as long as
/// the client lives. Call [`release`](Self::release) to know when it
/// happened.
///
/// A re-entrant acquire of a name this client holds returns another `Lock`
/// for the same grant. Such `Lock`s are counted holds of one lock: they
/// share validity and the lost signal, are renewed once, and releasing or
/// dropping one gives only its hold back; the last releases the grant and
/// marks it lost ([`LostReason::Released`]).
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
    /// What this lock needs of its client (releasing, the renewal task);
    /// holding it keeps the renewal task running.
    keeper: Arc<Keeper>,
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
    pub(crate) fn new(shared: Arc<Shared>, keeper: Arc<Keeper>) -> Self {
        Self {
            handle: LockHandle { shared },
            keeper,
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

    /// The router's opaque id of this grant. An
    /// [`extend_to`](Self::extend_to) another TTL changes it.
    pub fn lock_id(&self) -> String {
        self.handle.lock_id()
    }

    /// The lock's TTL: the one it was acquired with, or the last one
    /// [`extend_to`](Self::extend_to) gave it.
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

    /// Renews the lock now, instead of at its next scheduled renewal, and
    /// returns the validity it has from this renewal: a little less than
    /// its TTL. Like redis-py's or redlock's `extend` with the lock's own
    /// TTL; [`extend_to`](Self::extend_to) gives it another. Background
    /// renewal goes on as before; this is for a caller about to start a
    /// long step who wants the most validity it can have first.
    ///
    /// [`Error::Lost`] if the router says the lock is gone (it is then lost,
    /// here and for every view of it) or it was lost already; transport
    /// errors and error answers as they come (the lock stays as it was).
    pub async fn extend(&self) -> Result<Duration, Error> {
        self.extend_to(self.ttl()).await
    }

    /// Gives the lock a new TTL (longer or shorter) and returns the
    /// validity it has under it: the router moves the lock to this
    /// client's session lease of that TTL, with the same fencing token and
    /// a new [`lock_id`](Self::lock_id). From the answer on, this lock (and
    /// every `Lock` and handle of its grant) has the new lockId and TTL,
    /// its validity counts from this request's send, and background
    /// renewal follows the new TTL. A TTL equal to the lock's is
    /// [`extend`](Self::extend).
    ///
    /// A release of the lock waits for an extend on the wire, so the two
    /// never cross. A renewal the background task sent under the old
    /// lockId and answered after the move (`stolen`) is ignored, not taken
    /// as a loss.
    ///
    /// [`Error::Lost`] if the router says the lock is gone (it is then
    /// lost, as with a renewal) or it was lost already. Any other error
    /// (transport, timeout, 503, 504) leaves the lock under its old lockId,
    /// though the move may have happened at the router: the next renewal
    /// then finds the old lockId `stolen` and the lock is lost
    /// ([`LostReason::Stolen`]), since the client cannot learn the new
    /// lockId (docs/client.md, "Extend to another TTL").
    pub async fn extend_to(&self, ttl: Duration) -> Result<Duration, Error> {
        let shared = &self.handle.shared;
        let keeper = &self.keeper;
        let lost = |reason| Error::Lost {
            name: shared.name.clone(),
            reason,
        };
        if ttl.is_zero() || u64::try_from(ttl.as_millis()).is_err() {
            return Err(Error::Config(format!("ttl {ttl:?} out of range")));
        }
        // Releases of the grant wait until this one is answered.
        let _moving = shared.moving.lock().await;
        if let Some(reason) = shared.lost_now() {
            return Err(lost(reason));
        }
        let grant = shared.grant();
        let timeout = keeper.request_timeout;
        let sent_at = Instant::now();
        if ttl == grant.ttl {
            let answer = keeper
                .transport
                .renew_now(&grant.lock_ref, ttl, timeout)
                .await?;
            let answer = match (answer.renewed, answer.expires_in_ms) {
                (true, Some(ms)) => Ok(valid_until(sent_at, ms, grant.margin)),
                _ => Err(lost_reason(answer.reason.as_deref())),
            };
            shared.apply_renewal(grant.generation, answer);
        } else {
            let answer = keeper
                .transport
                .extend(&grant.lock_ref, ttl, timeout)
                .await?;
            match (answer.renewed, answer.lock_id, answer.expires_in_ms) {
                (true, Some(lock_id), Some(ms)) => {
                    let margin = validity::margin(ttl, keeper.margin);
                    let until = valid_until(sent_at, ms, margin);
                    if keeper.registry.switch(shared, &lock_id, ttl, margin, until) {
                        let _ = keeper.commands.send(Command::Extended { key: shared.key });
                    }
                }
                (true, _, _) => {
                    return Err(Error::Router {
                        status: 200,
                        code: "malformed_answer".into(),
                        message: "extended without lockId or expiresInMs".into(),
                        retry_after: None,
                    })
                }
                (false, _, _) => {
                    shared.apply_renewal(
                        grant.generation,
                        Err(lost_reason(answer.reason.as_deref())),
                    );
                }
            }
        }
        match shared.lost_now() {
            Some(reason) => Err(lost(reason)),
            None => Ok(self.time_left()),
        }
    }

    /// A cloneable view of this lock to hand to other tasks.
    pub fn handle(&self) -> LockHandle {
        self.handle.clone()
    }

    /// Stops renewing and releases the lock at the router. The lock counts
    /// as lost ([`LostReason::Released`]) from the start, here and in every
    /// other `Lock` of the same grant. If this is a re-entrant hold and
    /// others of the grant remain, it only gives its hold back and returns
    /// `Ok` at once.
    ///
    /// `Ok` comes only after the router confirmed: the name is then not
    /// held under this lock's id. Transport errors, 429 and 5xx answers
    /// (503 `shard_unavailable`) are retried with backoff while the lock's
    /// validity lasts, so this can take that long; any other error ends it
    /// at once. No retry comes sooner than the router's `Retry-After`
    /// ([`Error::retry_after`]); when that would be past the lock's
    /// validity, the router's error is returned at once and the background
    /// task sends the next attempt once it has passed. If validity runs out
    /// first, the error is returned and the client's background task keeps
    /// retrying, more slowly, for as long as the client lives: the lock
    /// shares a session lease with this client's other locks of its TTL on
    /// its shard, so while those are renewed it does not expire on its own.
    /// Cancelling this call hands the release to the background task too.
    ///
    /// If the lock was lost and this client has since acquired the same
    /// grant again through a newer `Lock`, the grant is that `Lock`'s: this
    /// call leaves it alone and returns [`Error::Lost`].
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        let shared = self.handle.shared.clone();
        let keeper = self.keeper.clone();
        let LetGo::Last(turn) = keeper.holds.let_go(&shared) else {
            // A re-entrant hold: the grant stays with the holds left.
            return Ok(());
        };
        let started = keeper.registry.begin_release(&shared);
        drop(turn);
        let Some(owner) = started else {
            return Err(Error::Lost {
                name: shared.name.clone(),
                reason: shared.current().lost.unwrap_or(LostReason::Released),
            });
        };
        if owner {
            let _ = keeper.commands.send(Command::Forget { key: shared.key });
        }
        // Whoever started the release delivers it; another `Lock` of the
        // grant may release it as well (the router's release is
        // idempotent), but leaves the background to the owner.
        let mut handoff = HandOff {
            shared: owner.then(|| shared.clone()),
            commands: &keeper.commands,
            tries: Tries::default(),
        };
        let (transport, timeout, state) = (&keeper.transport, keeper.request_timeout, &*shared);
        let attempt = move || release::attempt(transport, state, timeout);
        let result =
            release::retry(&shared, attempt, &mut handoff.tries, Until::ValidityEnds).await;
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
    /// Attempts made so far, so the task continues the backoff and keeps
    /// the router's `Retry-After`.
    tries: Tries,
}

impl Drop for HandOff<'_> {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let _ = self.commands.send(Command::Release {
                shared,
                tries: self.tries,
            });
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if let LetGo::Last(turn) = self.keeper.holds.let_go(&self.handle.shared) {
            self.keeper.release_in_background(&self.handle.shared);
            drop(turn);
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
        self.shared.fencing_token
    }

    /// See [`Lock::lock_id`].
    pub fn lock_id(&self) -> String {
        self.shared.lock_id()
    }

    /// See [`Lock::ttl`].
    pub fn ttl(&self) -> Duration {
        self.shared.ttl()
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

fn valid_until(sent_at: Instant, expires_in_ms: u64, margin: Duration) -> Instant {
    validity::valid_until(sent_at, Duration::from_millis(expires_in_ms), margin)
}

/// Why a lock the router answered `renewed: false` for is lost.
fn lost_reason(reason: Option<&str>) -> LostReason {
    match reason {
        Some("stolen") => LostReason::Stolen,
        _ => LostReason::Expired,
    }
}

impl std::fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.shared.current();
        f.debug_struct("Lock")
            .field("name", &self.shared.name)
            .field("fencing_token", &self.shared.fencing_token)
            .field("lost", &s.lost)
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::state::tests::shared;

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
