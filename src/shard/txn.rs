//! The shard's calls on one lock name: the grant, the release, the read of
//! everything that decides whether a name is grantable, and the
//! lost-holder txns behind the lock-delay (see `docs/design.md`, sections
//! 3 and 7). The txns themselves are built in `name.rs`; the grant at the
//! head of a waiting queue is in `queue.rs`.

use std::future::Future;
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use futures::StreamExt;

use super::conn::EtcdError;
use super::keys::{HeldValue, LockValue, Stored};
use super::name::{
    gets, grant_ops, name_reads, read_name, AcquireTxn, Grantable, NameKeys, NameState, ReleaseTxn,
    SessionGrant,
};
use super::sessions::SessionLease;
use super::{Renewal, Shard};
use crate::config::LockDelay;

/// Most lost holders one step of the paced sweep settles (three calls
/// each): a step must not hold up the monitor's tick for long.
pub const SWEEP_STEP_LOST: usize = 100;
/// Lost holders a sweep settles at once.
const SETTLING_AT_ONCE: usize = 8;
/// Times a read that settles a cut-off grant txn's outcome is sent
/// ([`Shard::read_name_settled`]), each under the shard's deadline.
const SETTLED_READ_TRIES: u32 = 3;

impl Shard {
    /// The grant cut-off every acquire txn compares (the last seen).
    pub fn cutoff(&self) -> i64 {
        self.cutoff.seen()
    }

    /// The cut-off a refused txn read: kept as the one to compare.
    pub fn learn_cutoff(&self, mark: i64) {
        self.cutoff.learn(mark);
    }

    /// Moves the grant cut-off past `compared`, the cut-off a grant txn
    /// that went unanswered compared, so that the txn grants nothing if it
    /// lands later (`docs/design.md`, "An acquire that was not answered").
    /// The move runs in a task of its own: a request that stops waiting
    /// (its deadline passed) does not stop it. It is waited for even when
    /// the shard is marked down meanwhile (a shard of one endpoint is, by
    /// the very call that went unanswered; one of several by the
    /// monitor's probes failing through the same fault): a shard that
    /// answers the move gives the caller a definite answer, as after a
    /// pause, an election or a connection broken once. On a shard that
    /// answers nobody the caller waits one deadline more, and no longer:
    /// callers queued behind a move that failed fail at once
    /// ([`Cutoff::move_past`](super::cutoff::Cutoff::move_past)).
    pub async fn move_cutoff_past(&self, compared: i64) -> Result<(), EtcdError> {
        let (conn, keys, cutoff) = (self.conn.clone(), self.keys.clone(), self.cutoff.clone());
        let moving = tokio::spawn(async move { cutoff.move_past(&conn, &keys, compared).await });
        moving
            .await
            .unwrap_or_else(|e| Err(self.conn.unavailable(format!("cut-off move: {e}"))))
    }

    /// Grants the name to `lease` if nobody holds it, no lock-delay or lost
    /// holder is pending, nobody is queued, and the shard still records
    /// `g`'s ring and identity; otherwise reads why not. `replace_held`:
    /// the mod revision of a lost holder's held record to overwrite (only
    /// when lock-delay is off). Goes to etcd in whatever group commit it
    /// joins (see [`commit`](super::commit)). A grant it makes looks held
    /// until the cache applies it; its caller marks it in flight
    /// ([`Shard::grant_on_session`]).
    async fn acquire_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let txn = self
            .committer
            .acquire(k, value, lease, g, replace_held)
            .await;
        if let Ok(AcquireTxn::Granted { revision }) = txn {
            self.cache.granted(k.hash, revision);
        }
        txn
    }

    /// The whole grant of `k`'s name to `value.client` on its `session`:
    /// the grant txn ([`Shard::acquire_txn`]) with the session kept alive
    /// alongside (a keepalive unless one was confirmed less than `window`
    /// ago).
    ///
    /// A session known to outlast the txn goes with it, concurrently, and
    /// the grant is answered once the txn is ([`answered_with_txn`]). The
    /// txn is applied within the etcd deadline or fails; with a TTL shorter
    /// than that, half the TTL (a txn slower than that only risks a
    /// refusal, never a double grant). Any other session (its client was
    /// idle) is renewed first, and only a live lease gets the txn: a lease
    /// that ran out without etcd having revoked it yet would still take a
    /// key, which then goes with the lease and leaves a held record that
    /// looks like a lost holder. The grant is in flight (what acquires of
    /// the same name wait for) from the start, the slow branch's keepalive
    /// included, until the grant is answered.
    ///
    /// The txn is counted on the session from before it is sent until it
    /// is answered ([`Sessions::begin_use`]), so the session's lease is not
    /// handed on meanwhile; a lease already handed on is `SessionGone`.
    ///
    /// [`Sessions::begin_use`]: super::sessions::Sessions::begin_use
    pub async fn grant_on_session(
        &self,
        k: &NameKeys,
        value: &LockValue,
        session: &SessionLease,
        window: Duration,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<SessionGrant, EtcdError> {
        let (lease, ttl_secs) = (session.id, session.ttl_secs);
        // Counted on the session before anything is sent, so that its lease
        // is not handed on with this txn in flight; not the session's any
        // more (handed on since the acquire got it): start again.
        let Some(counted) = self.sessions.begin_use(&value.client, ttl_secs, lease) else {
            return Ok(SessionGrant::SessionGone);
        };
        let margin = (self.conn.timeout()).min(Duration::from_millis(u64::from(ttl_secs) * 500));
        // In flight from the start (the slow branch's keepalive included)
        // until the grant is answered, failed or cancelled: the acquires of
        // the name that come meanwhile wait for it, then find a grant made
        // looking held.
        let flight = self.cache.granting(k.hash);
        let believed_alive = self.keepalive.lasts(lease, margin);
        // Its last confirmed renewal vouches for it now (a session past
        // that was replaced before it got here), if not for the txn too;
        // asked again only when not for the txn.
        let vouched = believed_alive || self.keepalive.lasts(lease, Duration::ZERO);
        let (txn, renewal) = if believed_alive {
            answered_with_txn(
                self.acquire_txn(k, value, lease, g, replace_held),
                self.keepalive.refresh(lease, window, ttl_secs),
                || self.keepalive.confirmed(lease),
            )
            .await
        } else {
            let renewal = match self.keepalive.refresh(lease, window, ttl_secs).await {
                Ok(renewal) => renewal,
                Err(e) => {
                    counted.settled(); // no txn was sent
                    return Err(e);
                }
            };
            if renewal.alive() {
                let txn = self.acquire_txn(k, value, lease, g, replace_held).await;
                (txn, Ok(renewal))
            } else {
                (Err(EtcdError::LeaseNotFound), Ok(renewal))
            }
        };
        drop(flight);
        if matches!(txn, Ok(_) | Err(EtcdError::LeaseNotFound)) {
            counted.settled();
        } // else it may still commit: dropped unanswered, it pins the lease
        let lease_gone =
            matches!(txn, Err(EtcdError::LeaseNotFound)) || matches!(renewal, Ok(r) if !r.alive());
        if lease_gone {
            // Ended early if it was vouched for: the next attempt is then
            // granted a fresh lease, not handed a spare.
            self.session_gone(&value.client, session, vouched).await;
            return Ok(SessionGrant::SessionGone);
        }
        Ok(SessionGrant::Answered(txn?, renewal))
    }

    /// One linearizable read of a name's keys and the shard's ring and
    /// identity (the handoff check of a migration, inspect, an acquire's
    /// read first), hedged.
    pub async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        let resp = self
            .conn
            .txn_hedged(Txn::new().and_then(name_reads(&self.keys, k)))
            .await?;
        Ok(read_name(resp))
    }

    /// [`Shard::read_name`] for learning what a grant txn did once the
    /// grant cut-off moved past it (an acquire's, a waiter's grant, an
    /// extend's move): its outcome is settled then, and its caller must be
    /// told it rather than an error that leaves it unknown. So the read
    /// goes to every member at once ([`EtcdConn::txn_everywhere`]) and is
    /// sent again, up to [`SETTLED_READ_TRIES`] times within the request's
    /// deadline, until one answers.
    ///
    /// [`EtcdConn::txn_everywhere`]: super::conn::EtcdConn::txn_everywhere
    pub async fn read_name_settled(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        let txn = Txn::new().and_then(name_reads(&self.keys, k));
        let mut tries = 1;
        loop {
            match self.conn.txn_everywhere(txn.clone()).await {
                Ok(resp) => return Ok(read_name(resp)),
                Err(e) if tries >= SETTLED_READ_TRIES || crate::task::past_request_deadline() => {
                    return Err(e)
                }
                Err(_) => tries += 1,
            }
            tokio::time::sleep(super::conn::HEDGE_AFTER).await;
        }
    }

    /// Turns a lost holder's held record into a lock-delay on `delay_lease`
    /// if the name is still not held and the record unchanged. Returns
    /// whether it did.
    pub async fn lost_to_delay(
        &self,
        k: &NameKeys,
        held: &Stored,
        delay_lease: i64,
        identity: &[u8],
    ) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
                Compare::value(self.keys.identity(), CompareOp::Equal, identity.to_vec()),
            ])
            .and_then([
                TxnOp::delete(k.held.clone(), None),
                TxnOp::put(
                    k.delay.clone(),
                    held.value().to_vec(),
                    Some(PutOptions::new().with_lease(delay_lease)),
                ),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Forgets a lost holder's held record (lock-delay off) if the name is
    /// still not held and the record unchanged.
    pub async fn forget_lost(&self, k: &NameKeys, held: &Stored) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
            ])
            .and_then([TxnOp::delete(k.held.clone(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Deletes the lock key (and its held record) only if the key still has
    /// this create revision and lease, in whatever group commit it joins:
    /// one raft write, no read. Returns whether it deleted, and when the
    /// deleted lock was granted (its value comes back with the delete).
    pub async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<ReleaseTxn, EtcdError> {
        let txn = self.committer.release(k, revision, lease).await;
        if matches!(txn, Ok(ReleaseTxn::Released { .. })) {
            self.cache.released(&k.hash, revision);
        }
        txn
    }

    /// Moves a held lock onto the session lease `lease` with a new TTL
    /// (an extend): puts the lock key with `value` on `lease` and its held
    /// record, as a grant writes them ([`grant_ops`]), only if the key and
    /// the record are still the versions `lock` and `held_was` (their mod
    /// revisions; an absent record compares as 0), the shard still
    /// carries `identity` and its grant cut-off is still `cutoff`. A put
    /// keeps a key's create revision, so the lock keeps its fencing token.
    /// Returns whether it moved; a failed compare means the lock changed
    /// (released, expired, taken, or moved by another call) or the
    /// cut-off moved (kept from the txn's read): read again. A lock moved
    /// onto `lease` counts as a renewal of it ([`Shard::sweep_sessions`]).
    pub async fn move_lock(
        &self,
        k: &NameKeys,
        (lock, held_was): (&Stored, Option<&Stored>),
        value: &LockValue,
        lease: i64,
        (identity, cutoff): (&[u8], i64),
    ) -> Result<bool, EtcdError> {
        let held_rev = held_was.map_or(0, Stored::mod_revision);
        let txn = Txn::new()
            .when([
                Compare::mod_revision(k.lock.clone(), CompareOp::Equal, lock.mod_revision()),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held_rev),
                Compare::value(self.keys.identity(), CompareOp::Equal, identity.to_vec()),
                self.keys.cutoff_compare(cutoff),
            ])
            .and_then(grant_ops(k, value, lease))
            .or_else([self.keys.cutoff_read()]);
        let resp = self.txn(txn).await?;
        if !resp.succeeded() {
            let read = gets(resp).next().flatten();
            self.learn_cutoff(self.keys.cutoff_of(read));
            return Ok(false);
        }
        self.sessions.touch(lease);
        Ok(true)
    }

    /// Sets the lock-delay of a lost holder's name: grants a lease of `ttl`
    /// seconds (plus one, for rounding and clock rates) and moves the held
    /// record onto it. Returns when the delay ends at the earliest, and
    /// whether this call set it.
    pub async fn set_lock_delay(
        &self,
        k: &NameKeys,
        held: &Stored,
        identity: &[u8],
    ) -> Result<(Instant, bool), EtcdError> {
        let ttl = serde_json::from_slice::<HeldValue>(held.value())
            .map(|h| h.ttl)
            .unwrap_or(0);
        let sent = Instant::now();
        // Granted after the key was seen gone, so it ends no earlier than one
        // delay after the lost holder's key went.
        let (lease, granted) = self.grant(ttl.max(1) + 1).await?;
        let until = sent + Duration::from_secs(granted.max(0) as u64);
        let set = self.lost_to_delay(k, held, lease, identity).await?;
        if set {
            crate::metrics::lock_delay_set(&self.name);
            tracing::info!(shard = %self.name, ttl, "a holder was lost without releasing: lock-delay set");
        } else {
            let _ = self.revoke(lease).await;
        }
        Ok((until, set))
    }

    /// Deals with every held record whose lock key is gone (holders lost
    /// without releasing, whose names nobody asked for since): sets their
    /// lock-delays, or with lock-delay off forgets them, so that records do
    /// not pile up and a migration's moved names do not wait for them.
    pub async fn sweep_lost(&self, lock_delay: LockDelay) {
        let Some(identity) = self.verified_identity() else {
            return;
        };
        let Ok(orphans) = self.orphaned_held().await else {
            return;
        };
        self.settle_lost(&orphans, lock_delay, &identity).await;
    }

    /// One step of the paced sweep: [`Shard::sweep_lost`] a page of held
    /// records at a time (`scan::Sweep`), at most [`SWEEP_STEP_LOST`] lost
    /// holders settled per step; a new pass at most once per `every`.
    pub async fn sweep_step(&self, lock_delay: LockDelay, every: Duration) {
        let Some(identity) = self.verified_identity() else {
            return;
        };
        let Some(mut pages) = self
            .sweep
            .lock()
            .expect("sweep lock")
            .begin(self.keys.held_range(), every)
        else {
            return;
        };
        match self.next_orphans(&mut pages).await {
            Ok(Some(mut orphans)) => {
                if orphans.len() > SWEEP_STEP_LOST {
                    orphans.truncate(SWEEP_STEP_LOST);
                    let last = orphans.last().expect("more than none");
                    pages.resume_after(last.key());
                }
                if !self.settle_lost(&orphans, lock_delay, &identity).await {
                    return; // the shard is struggling: the pass starts again later
                }
            }
            // The pass is over, or the shard failed the read: a new pass
            // starts at its time.
            Ok(None) | Err(_) => return,
        }
        self.sweep.lock().expect("sweep lock").keep(pages);
    }

    /// Sets the lock-delay of (or forgets) each lost holder of `orphans`,
    /// [`SETTLING_AT_ONCE`] at a time; false if the shard failed a call (the
    /// others were still tried).
    async fn settle_lost(
        &self,
        orphans: &[Stored],
        lock_delay: LockDelay,
        identity: &[u8],
    ) -> bool {
        let settle = |orphan: &Stored| {
            let key = orphan.key().to_vec();
            async move {
                // The sweep read keys only: read the record itself (its TTL,
                // and the mod revision the conversion compares).
                let Some(held) = self.get(&key).await? else {
                    return Ok(());
                };
                let k = self.keys_of_held(&held);
                match lock_delay {
                    LockDelay::Ttl => self.set_lock_delay(&k, &held, identity).await.map(|_| ()),
                    LockDelay::Off => self.forget_lost(&k, &held).await.map(|_| ()),
                }
            }
        };
        let results: Vec<Result<(), EtcdError>> = futures::stream::iter(orphans.iter().map(settle))
            .buffer_unordered(SETTLING_AT_ONCE)
            .collect()
            .await;
        results.iter().all(Result::is_ok)
    }
}

/// A grant `txn` and its session's keepalive `renew`, sent together, and
/// answered once the txn is: with the keepalive's answer if it has come by
/// then, else with `known()`, the lease's last confirmed renewal (its
/// deadline is still ahead: the caller checked that it outlasts the txn).
/// Only without one does it wait for the keepalive.
///
/// The keepalive left unanswered is not withdrawn: it went to the shard's
/// keepalive task when first polled (unless that task's queue was full:
/// then the next renewal sends one), and the task sends it and learns its
/// answer whoever waits for it, so the lease is renewed as before and the
/// next renewal or acquire on it finds that answer. The grant's answer
/// then reports the time the lease had before it, less than a full TTL
/// but never more than the truth (docs/design.md, section 6, "An acquire
/// waits for its txn, not its keepalive").
async fn answered_with_txn<T>(
    txn: impl Future<Output = T>,
    renew: impl Future<Output = Result<Renewal, EtcdError>>,
    known: impl FnOnce() -> Option<Renewal>,
) -> (T, Result<Renewal, EtcdError>) {
    use futures::future::{select, Either};
    use futures::FutureExt;

    let (txn, mut renew) = (std::pin::pin!(txn), std::pin::pin!(renew));
    match select(txn, renew.as_mut()).await {
        Either::Right((renewal, txn)) => (txn.await, renewal),
        Either::Left((txn, _)) => match renew.as_mut().now_or_never() {
            Some(renewal) => (txn, renewal),
            None => match known() {
                Some(known) => (txn, Ok(known)),
                None => (txn, renew.await),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{answered_with_txn, EtcdError, Renewal};

    const MS: Duration = Duration::from_millis(1);

    fn renewal(sent_at: Instant, ttl_secs: i64) -> Renewal {
        Renewal { sent_at, ttl_secs }
    }

    /// A grant whose txn is answered after `txn` and its keepalive after
    /// `renew` (with `renewed`), the lease's last confirmed renewal being
    /// `known` (in paused time): what the grant is answered with, and
    /// when.
    async fn grant(
        txn: Duration,
        renew: Duration,
        renewed: Result<Renewal, EtcdError>,
        known: Option<Renewal>,
    ) -> (Result<Renewal, EtcdError>, Duration) {
        let start = tokio::time::Instant::now();
        let (txn, renewal) =
            answered_with_txn(after(txn, "granted"), after(renew, renewed), || known).await;
        assert_eq!(txn, "granted");
        (renewal, start.elapsed())
    }

    /// Answers `value` after `delay` of (paused) time.
    async fn after<T>(delay: Duration, value: T) -> T {
        tokio::time::sleep(delay).await;
        value
    }

    /// A renewal sent now, and one confirmed 20 s ago (30 s TTLs).
    fn now_and_earlier() -> (Renewal, Renewal) {
        let now = Instant::now();
        (renewal(now, 30), renewal(now - Duration::from_secs(20), 30))
    }

    #[tokio::test(start_paused = true)]
    async fn a_keepalive_answered_first_is_the_grants_answer() {
        let (fresh, earlier) = now_and_earlier();
        let (renewed, took) = grant(5 * MS, 2 * MS, Ok(fresh), Some(earlier)).await;
        let renewed = renewed.unwrap();
        assert_eq!(
            renewed.sent_at, fresh.sent_at,
            "the fresh keepalive's answer"
        );
        assert_eq!(took, 5 * MS, "answered with the txn");
    }

    #[tokio::test(start_paused = true)]
    async fn a_keepalive_answered_with_the_txn_is_the_grants_answer() {
        let (fresh, earlier) = now_and_earlier();
        let (renewed, took) = grant(5 * MS, 5 * MS, Ok(fresh), Some(earlier)).await;
        assert_eq!(renewed.unwrap().sent_at, fresh.sent_at);
        assert_eq!(took, 5 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slower_keepalive_is_not_waited_for_when_the_lease_is_known_alive() {
        let (fresh, earlier) = now_and_earlier();
        let (renewed, took) = grant(5 * MS, 500 * MS, Ok(fresh), Some(earlier)).await;
        let renewed = renewed.unwrap();
        assert_eq!(
            renewed.sent_at, earlier.sent_at,
            "the last confirmed renewal, never more"
        );
        assert_eq!(renewed.ttl_secs, 30);
        assert_eq!(took, 5 * MS, "answered with the txn, not the keepalive");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_confirmed_renewal_the_keepalive_is_waited_for() {
        let (fresh, _) = now_and_earlier();
        let (renewed, took) = grant(5 * MS, 500 * MS, Ok(fresh), None).await;
        assert_eq!(renewed.unwrap().sent_at, fresh.sent_at);
        assert_eq!(took, 500 * MS);
    }

    #[tokio::test(start_paused = true)]
    async fn a_keepalive_that_finds_the_lease_gone_first_is_the_answer() {
        let (_, earlier) = now_and_earlier();
        let gone = renewal(Instant::now(), 0);
        let (renewed, _) = grant(5 * MS, MS, Ok(gone), Some(earlier)).await;
        assert!(
            !renewed.unwrap().alive(),
            "the lease found gone is what the grant learns"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_keepalive_before_the_txn_is_passed_on() {
        let (_, earlier) = now_and_earlier();
        let failed = Err(EtcdError::LeaseNotFound);
        let (renewed, _) = grant(5 * MS, MS, failed, Some(earlier)).await;
        assert!(matches!(renewed, Err(EtcdError::LeaseNotFound)));
    }
}
