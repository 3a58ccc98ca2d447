//! The client's one background renewal task: it renews every held lock of
//! its client with `renew-batch` calls (up to 1,000 locks each), so the
//! number of requests grows with the number of clients, not of locks.
//!
//! Each lock is due a third of its TTL after its last confirmed renewal.
//! When any lock is due, every lock due within the next half interval rides
//! along, so locks taken at different moments fall into step and share one
//! request per interval. A refusal (`expired`, `stolen`) marks that lock lost
//! at once; transport errors, 5xx answers and per-item `shard_unavailable`
//! are retried with backoff and jitter until the lock's validity runs out,
//! and then it is lost. If the router rejects a whole batch (4xx: a lower
//! batch limit, or one entry it cannot read), the locks are renewed one by
//! one, so the batch's refusal never costs the other locks.
//!
//! A failed renewal's `Retry-After` is kept only where that schedule has
//! room for it: the retry waits for it when it is no longer than the
//! backoff's cap (the longest pause between retries anyway) and ends
//! within the lock's validity; otherwise it comes after the plain backoff,
//! since a renewal held back longer could cost a lock the router still
//! holds (`validity::renewal_pause`).
//!
//! It also delivers the releases handed to it (dropped locks, and releases
//! [`Lock::release`](crate::Lock::release) could not finish within the
//! lock's validity), retrying them for as long as the client lives (see
//! `release`).
//!
//! The task ends when every [`Client`](crate::Client) and
//! [`Lock`](crate::Lock) of its client is gone (its command channel closes).
//! Pending releases then get one request timeout more, at the fast pace,
//! and are dropped: a task must not outlive its client by more than that,
//! and with no `Lock` left, nothing of this client renews its session
//! leases any more, so its locks expire at their TTL.
//!
//! It works on the grants' shared state (`state`) through the transport,
//! the validity clock and `release`; clients and locks reach it only by its
//! [`Command`]s.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{join_all, BoxFuture};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::LostReason;
use crate::release::{self, Tries, Until};
use crate::state::Shared;
use crate::transport::{LockRef, Renewed, Transport};
use crate::validity::{self, MAX_BACKOFF};

/// The most locks one `renew-batch` call may carry (the API's limit).
pub const MAX_BATCH: usize = 1_000;

/// Messages from clients and locks to the task.
pub(crate) enum Command {
    /// Start renewing a lock that was just acquired (once per grant).
    Track(Arc<Shared>),
    /// An extend moved the lock to another TTL: its renewal schedule
    /// follows the new one.
    Extended { key: u64 },
    /// Stop renewing a lock: its release is under way elsewhere.
    Forget { key: u64 },
    /// Stop renewing a lock and release it at the router, retrying;
    /// `tries`: how the attempts already made went. The release is sent
    /// even if the lock already counts as lost: when it was lost by the
    /// clock alone, its key may still stand and block others.
    Release { shared: Arc<Shared>, tries: Tries },
}

/// One tracked lock.
struct Entry {
    shared: Arc<Shared>,
    interval: Duration,
    /// When the next renewal should be sent.
    next_due: Instant,
    /// Consecutive failed attempts, for backoff.
    failures: u32,
    /// A renewal for it is on the wire; do not send another.
    in_flight: bool,
}

/// What became of one lock's renewal attempt.
enum Outcome {
    Renewed {
        expires_in: Duration,
    },
    Lost(LostReason),
    /// Try again; `after`: the router's `Retry-After` on the failed answer.
    Retry {
        after: Option<Duration>,
    },
}

/// A finished background request.
enum Done {
    Renewals {
        sent_at: Instant,
        /// Per lock: its key, the generation of the grant it was sent
        /// under, what became of it.
        outcomes: Vec<(u64, u64, Outcome)>,
    },
    Released,
}

pub(crate) struct RenewalTask {
    transport: Transport,
    request_timeout: Duration,
    commands: mpsc::UnboundedReceiver<Command>,
    entries: HashMap<u64, Entry>,
    in_flight: FuturesUnordered<BoxFuture<'static, Done>>,
    /// Turns true once every handle of the client is gone, so pending
    /// releases stop pausing at the slow pace.
    gone: watch::Sender<bool>,
}

impl RenewalTask {
    pub fn new(
        transport: Transport,
        request_timeout: Duration,
        commands: mpsc::UnboundedReceiver<Command>,
    ) -> Self {
        Self {
            transport,
            request_timeout,
            commands,
            entries: HashMap::new(),
            in_flight: FuturesUnordered::new(),
            gone: watch::Sender::new(false),
        }
    }

    pub async fn run(mut self) {
        loop {
            let wake = self.next_wake();
            tokio::select! {
                cmd = self.commands.recv() => match cmd {
                    Some(cmd) => self.command(cmd),
                    None => break,
                },
                Some(done) = self.in_flight.next() => self.finished(done),
                _ = sleep_until_opt(wake) => self.tick(),
            }
        }
        // Every handle is gone: a last request timeout for the releases.
        self.gone.send_replace(true);
        let deadline = Instant::now() + self.request_timeout;
        let drain = async { while self.in_flight.next().await.is_some() {} };
        if tokio::time::timeout_at(deadline, drain).await.is_err() {
            tracing::warn!(
                "client gone with releases not confirmed; those locks expire at their TTL"
            );
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Extended { key } => {
                if let Some(e) = self.entries.get_mut(&key) {
                    e.interval = validity::renew_interval(e.shared.ttl());
                    let valid_until = e.shared.current().valid_until;
                    e.next_due = validity::next_renewal(Instant::now(), valid_until, e.interval);
                    e.failures = 0;
                }
            }
            Command::Track(shared) => {
                let interval = validity::renew_interval(shared.ttl());
                let next_due =
                    validity::next_renewal(Instant::now(), shared.current().valid_until, interval);
                self.entries.insert(
                    shared.key,
                    Entry {
                        shared,
                        interval,
                        next_due,
                        failures: 0,
                        in_flight: false,
                    },
                );
            }
            Command::Forget { key } => {
                self.entries.remove(&key);
            }
            Command::Release { shared, tries } => {
                self.entries.remove(&shared.key);
                let transport = self.transport.clone();
                let timeout = self.request_timeout;
                let gone = self.gone.subscribe();
                self.in_flight.push(Box::pin(async move {
                    let (t, s) = (&transport, &*shared);
                    let attempt = move || release::attempt(t, s, timeout);
                    let mut tries = tries;
                    // Errors are logged where they happen.
                    let _ =
                        release::retry(&shared, attempt, &mut tries, Until::ClientGone(gone)).await;
                    Done::Released
                }));
            }
        }
    }

    /// The earliest moment something is due: a renewal, or a validity that
    /// runs out.
    fn next_wake(&self) -> Option<Instant> {
        self.entries
            .values()
            .map(|e| {
                let until = e.shared.current().valid_until;
                if e.in_flight {
                    until
                } else {
                    e.next_due.min(until)
                }
            })
            .min()
    }

    fn tick(&mut self) {
        let now = Instant::now();
        self.entries.retain(|_, e| e.shared.lost_now().is_none());
        if !self
            .entries
            .values()
            .any(|e| !e.in_flight && e.next_due <= now)
        {
            return;
        }
        // Everything due soon rides along with what is due now.
        let mut batch: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.in_flight && e.next_due <= now + e.interval / 2)
            .map(|(k, _)| *k)
            .collect();
        batch.sort_unstable();
        for chunk in batch.chunks(MAX_BATCH) {
            self.send(chunk);
        }
    }

    fn send(&mut self, keys: &[u64]) {
        let mut locks = Vec::with_capacity(keys.len());
        // No point waiting for an answer past the interval: a later attempt
        // has a better chance.
        let mut timeout = self.request_timeout;
        for key in keys {
            if let Some(e) = self.entries.get_mut(key) {
                e.in_flight = true;
                timeout = timeout.min(e.interval.max(Duration::from_millis(500)));
                let grant = e.shared.grant();
                locks.push((*key, grant.generation, grant.lock_ref));
            }
        }
        let transport = self.transport.clone();
        self.in_flight.push(Box::pin(async move {
            let sent_at = Instant::now();
            let outcomes = renew(&transport, locks, timeout).await;
            Done::Renewals { sent_at, outcomes }
        }));
    }

    fn finished(&mut self, done: Done) {
        let Done::Renewals { sent_at, outcomes } = done else {
            return;
        };
        let now = Instant::now();
        for (key, generation, outcome) in outcomes {
            // A lock forgotten meanwhile (released) is no longer ours.
            let Some(e) = self.entries.get_mut(&key) else {
                continue;
            };
            e.in_flight = false;
            match outcome {
                Outcome::Renewed { expires_in } => {
                    let margin = e.shared.margin();
                    let until = validity::valid_until(sent_at, expires_in, margin);
                    // An answer for the lockId an extend replaced says
                    // nothing of the lock now: its next renewal asks anew.
                    if e.shared.apply_renewal(generation, Ok(until)).is_some() {
                        e.failures = 0;
                        let valid_until = e.shared.current().valid_until;
                        e.next_due = validity::next_renewal(sent_at, valid_until, e.interval);
                    }
                }
                Outcome::Lost(reason) => {
                    // `stolen` for a lockId an extend replaced is the
                    // extend's doing, not a loss.
                    if e.shared.apply_renewal(generation, Err(reason)) == Some(false) {
                        self.entries.remove(&key);
                    }
                }
                Outcome::Retry { after } => {
                    e.failures += 1;
                    let cap = MAX_BACKOFF.min(e.interval);
                    let left = e
                        .shared
                        .current()
                        .valid_until
                        .saturating_duration_since(now);
                    e.next_due = now + validity::renewal_pause(e.failures, cap, after, left);
                }
            }
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Renews `locks` with one `renew-batch` call; if the router rejects the
/// batch itself (4xx), renews each lock on its own instead.
async fn renew(
    transport: &Transport,
    locks: Vec<(u64, u64, LockRef)>,
    timeout: Duration,
) -> Vec<(u64, u64, Outcome)> {
    let refs: Vec<LockRef> = locks.iter().map(|(_, _, l)| l.clone()).collect();
    match transport.renew_batch(&refs, timeout).await {
        Ok(results) => locks
            .iter()
            .zip(results)
            .map(|((key, generation, _), r)| (*key, *generation, outcome(&r)))
            .collect(),
        Err(e) if e.is_retryable() => {
            tracing::debug!(error = %e, locks = locks.len(), "renewal failed; will retry");
            let after = e.retry_after();
            locks
                .iter()
                .map(|(k, g, _)| (*k, *g, Outcome::Retry { after }))
                .collect()
        }
        Err(e) => {
            tracing::warn!(error = %e, "renew-batch refused; renewing one by one");
            join_all(locks.iter().map(|(key, generation, lock)| async move {
                let o = match transport.renew(lock, timeout).await {
                    Ok(r) => outcome(&r),
                    Err(e) if e.is_retryable() => Outcome::Retry {
                        after: e.retry_after(),
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "the router refused to renew a lock");
                        Outcome::Lost(LostReason::Refused)
                    }
                };
                (*key, *generation, o)
            }))
            .await
        }
    }
}

fn outcome(r: &Renewed) -> Outcome {
    match (r.renewed, r.expires_in_ms, r.reason.as_deref()) {
        (true, Some(ms), _) => Outcome::Renewed {
            expires_in: Duration::from_millis(ms),
        },
        (false, _, Some("expired")) => Outcome::Lost(LostReason::Expired),
        (false, _, Some("stolen")) => Outcome::Lost(LostReason::Stolen),
        // shard_unavailable, or anything this client does not know yet:
        // nothing proves the lock gone, so try again while it is valid.
        _ => Outcome::Retry { after: None },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::shared;

    fn task() -> RenewalTask {
        let (_tx, rx) = mpsc::unbounded_channel();
        // Port 9 (discard) on loopback: nothing here is ever sent.
        let transport = Transport::new("http://127.0.0.1:9", None).unwrap();
        RenewalTask::new(transport, Duration::from_secs(5), rx)
    }

    #[tokio::test(start_paused = true)]
    async fn locks_due_close_together_share_one_batch_split_at_the_limit() {
        let mut task = task();
        let ttl = Duration::from_secs(30);
        for key in 0..2_500 {
            task.command(Command::Track(shared(key, ttl, ttl)));
            // Acquired over 2.5 s: all within half an interval (5 s) of the first.
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        task.tick();
        assert!(task.in_flight.is_empty(), "nothing is due yet");
        tokio::time::advance(Duration::from_secs(10)).await;
        task.tick();
        assert_eq!(task.in_flight.len(), 3, "2,500 locks in batches of 1,000");
        assert!(task.entries.values().all(|e| e.in_flight));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lock_due_much_later_waits_for_its_own_turn() {
        let mut task = task();
        let ttl = Duration::from_secs(30);
        task.command(Command::Track(shared(1, ttl, ttl)));
        tokio::time::advance(Duration::from_secs(8)).await;
        task.command(Command::Track(shared(2, ttl, ttl)));
        tokio::time::advance(Duration::from_secs(2)).await;
        task.tick();
        assert_eq!(task.in_flight.len(), 1);
        assert!(task.entries[&1].in_flight);
        assert!(!task.entries[&2].in_flight);
    }

    #[tokio::test(start_paused = true)]
    async fn outcomes_confirm_lose_or_back_off() {
        let mut task = task();
        let ttl = Duration::from_secs(30);
        for key in 0..3 {
            task.command(Command::Track(shared(key, ttl, ttl)));
        }
        let handles: Vec<_> = task.entries.values().map(|e| e.shared.clone()).collect();
        let sent_at = Instant::now();
        task.finished(Done::Renewals {
            sent_at,
            outcomes: vec![
                (
                    0,
                    0,
                    Outcome::Renewed {
                        expires_in: Duration::from_secs(60),
                    },
                ),
                (1, 0, Outcome::Lost(LostReason::Expired)),
                (2, 0, Outcome::Retry { after: None }),
            ],
        });
        let by_key = |k: u64| handles.iter().find(|s| s.key == k).unwrap();
        assert_eq!(
            by_key(0).current().valid_until,
            sent_at + Duration::from_secs(60) - Duration::from_millis(100)
        );
        assert_eq!(by_key(1).current().lost, Some(LostReason::Expired));
        assert!(!task.entries.contains_key(&1), "a lost lock is not renewed");
        let retry = &task.entries[&2];
        assert_eq!(retry.failures, 1);
        assert!(retry.next_due <= sent_at + Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn answers_for_a_lock_id_an_extend_replaced_are_not_applied() {
        let mut task = task();
        let ttl = Duration::from_secs(3);
        task.command(Command::Track(shared(1, ttl, ttl)));
        let lock = task.entries[&1].shared.clone();
        let sent_at = Instant::now();
        // A batch leaves with the old lockId, then an extend moves the lock.
        task.tick();
        tokio::time::advance(Duration::from_secs(1)).await;
        task.send(&[1]);
        let until = Instant::now() + Duration::from_secs(9);
        assert!(
            lock.switch(
                "id-1-moved".into(),
                secs(10),
                Duration::from_millis(100),
                until
            )
            .1
        );
        task.command(Command::Extended { key: 1 });
        assert_eq!(
            task.entries[&1].interval,
            validity::renew_interval(secs(10))
        );
        // The old lockId now answers `stolen`, or a late `renewed`.
        for stale in [
            Outcome::Lost(LostReason::Stolen),
            Outcome::Renewed {
                expires_in: Duration::from_secs(60),
            },
        ] {
            task.finished(Done::Renewals {
                sent_at,
                outcomes: vec![(1, 0, stale)],
            });
            assert_eq!(lock.current().lost, None, "not lost by a stale answer");
            assert_eq!(lock.current().valid_until, until, "nor moved by one");
            assert!(task.entries.contains_key(&1), "and still renewed");
        }
        // The same answer under the lockId it has now counts.
        task.finished(Done::Renewals {
            sent_at,
            outcomes: vec![(1, 1, Outcome::Lost(LostReason::Stolen))],
        });
        assert_eq!(lock.current().lost, Some(LostReason::Stolen));
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_retry_waits_for_retry_after_only_where_the_schedule_has_room() {
        let mut task = task();
        let ttl = Duration::from_secs(30);
        for key in 0..3 {
            task.command(Command::Track(shared(key, ttl, ttl)));
        }
        let now = Instant::now();
        task.finished(Done::Renewals {
            sent_at: now,
            outcomes: vec![
                (
                    0,
                    0,
                    Outcome::Retry {
                        after: Some(secs(1)),
                    },
                ),
                // Longer than the backoff's cap (2 s): the backoff alone.
                (
                    1,
                    0,
                    Outcome::Retry {
                        after: Some(secs(5)),
                    },
                ),
                (2, 0, Outcome::Retry { after: None }),
            ],
        });
        assert!(
            task.entries[&0].next_due >= now + secs(1),
            "as the router asked"
        );
        let backoff = now + Duration::from_millis(100);
        assert!(task.entries[&1].next_due <= backoff);
        assert!(task.entries[&2].next_due <= backoff);
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn answers_map_to_outcomes() {
        let r = |renewed, ms: Option<u64>, reason: Option<&str>| Renewed {
            renewed,
            expires_in_ms: ms,
            reason: reason.map(str::to_string),
        };
        assert!(matches!(
            outcome(&r(true, Some(5), None)),
            Outcome::Renewed { .. }
        ));
        assert!(matches!(
            outcome(&r(false, None, Some("expired"))),
            Outcome::Lost(LostReason::Expired)
        ));
        assert!(matches!(
            outcome(&r(false, None, Some("stolen"))),
            Outcome::Lost(LostReason::Stolen)
        ));
        assert!(matches!(
            outcome(&r(false, None, Some("shard_unavailable"))),
            Outcome::Retry { after: None }
        ));
    }
}
