//! Releasing a lock at the router until the router confirms.
//!
//! Why a release must get through: a lock's key lives on its client's
//! session lease for (client id, TTL, shard), and renewing any lock of that
//! session keeps the lease alive. A release the router never saw does not
//! end at the lock's TTL while this client renews other locks of that TTL
//! on that shard: the name stays held until the release gets through or the
//! client stops renewing. The router's release is idempotent (204 also when
//! the lock is already gone), so repeating it is always safe.
//!
//! Transport errors, 429 and 5xx answers (503 `shard_unavailable` above
//! all) are retried with backoff and jitter; any other 4xx ends it, since
//! the same request cannot fare better. [`Lock::release`](crate::Lock::release)
//! retries while the lock's validity lasts, at the renewal pace; the renewal
//! task then carries on at up to a renewal interval (a third of the TTL)
//! between attempts, for as long as the client lives.
//!
//! An answer with `Retry-After` (503 `overloaded` or `shard_unavailable`,
//! 429) is not followed by another attempt before that time has passed,
//! however short the backoff, and even when an acquire wakes the release
//! early: the router sheds load by it, and a client that came back sooner
//! would only be refused again. When it would pass the end of the lock's
//! validity, [`Lock::release`](crate::Lock::release) stops there and then
//! (its deadline could not be kept) and the renewal task, told when the
//! router may be asked again, carries on.
//!
//! Each attempt names the grant as it stands then, and waits for an extend
//! of it in flight: a release sent with a lockId an extend is replacing
//! would free nothing (see [`attempt`]).
//!
//! It touches only the grant's state (`state`), the transport, the
//! validity clock and the error types.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::Error;
use crate::state::{Release, Shared};
use crate::transport::Transport;
use crate::validity::{self, MAX_BACKOFF};

/// When a release stops retrying.
pub(crate) enum Until {
    /// When the lock's validity ends ([`Lock::release`](crate::Lock::release),
    /// which then hands the release to the renewal task).
    ValidityEnds,
    /// Never on its own (the renewal task, which drops the release once its
    /// client is gone). The receiver turns true when the client is gone:
    /// from then on attempts come at the fast pace.
    ClientGone(watch::Receiver<bool>),
}

/// One release request for the grant under the lockId it has now, never
/// while an extend of it is on the wire: the extend moves the lock to a
/// new lockId, and the old one releases nothing.
pub(crate) async fn attempt(
    transport: &Transport,
    shared: &Shared,
    timeout: Duration,
) -> Result<(), Error> {
    let _moving = shared.moving.lock().await;
    let lock_ref = shared.grant().lock_ref;
    transport.release(&lock_ref, timeout).await
}

/// How a release's attempts have gone so far; it starts past zero when the
/// renewal task takes over a release [`Lock::release`](crate::Lock::release)
/// began.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tries {
    /// Failed attempts, for the backoff.
    pub failures: u32,
    /// No attempt before this: the `Retry-After` of the last failed
    /// attempt's answer, counted from when it came.
    pub not_before: Option<Instant>,
}

/// Calls `attempt` (one release request) until it succeeds, fails with an
/// error not worth retrying, or `until` says stop. `tries` records the
/// failed attempts, and may start with some when the release was handed
/// over. Stops at once, with `Ok`, when another `Lock` of the grant got the
/// 204.
pub(crate) async fn retry<F, Fut>(
    shared: &Shared,
    mut attempt: F,
    tries: &mut Tries,
    mut until: Until,
) -> Result<(), Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), Error>>,
{
    let interval = validity::renew_interval(shared.ttl());
    let fast = MAX_BACKOFF.min(interval);
    let slow = interval.max(fast);
    let mut warned = false;
    let mut last = None;
    loop {
        if tries.failures > 0 {
            let now = Instant::now();
            let valid_until = shared.current().valid_until;
            let asked = tries
                .not_before
                .map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
            let pause = match &until {
                Until::ValidityEnds => {
                    let left = valid_until.saturating_duration_since(now);
                    // The router's wait ends past validity: no attempt fits.
                    if left.is_zero() || asked > left {
                        return Err(last.unwrap_or_else(|| unconfirmed(shared)));
                    }
                    validity::backoff(tries.failures, fast).min(left).max(asked)
                }
                Until::ClientGone(gone) => {
                    let valid = now < valid_until;
                    if !valid && !warned {
                        warned = true;
                        tracing::warn!(
                            name = %shared.name,
                            "release not confirmed within the lock's validity; retrying \
                             while the client lives (the lock may stay held meanwhile)"
                        );
                    }
                    let pace = if valid || *gone.borrow() { fast } else { slow };
                    validity::backoff(tries.failures, pace).max(asked)
                }
            };
            pause_for(pause, tries.not_before, shared, &mut until).await;
        }
        if shared.current().release == Release::Done {
            return Ok(());
        }
        match attempt().await {
            Ok(()) => {
                shared.end_release(Release::Done);
                return Ok(());
            }
            Err(e) if !e.is_retryable() => {
                tracing::warn!(name = %shared.name, error = %e, "the router refused to release a lock");
                shared.end_release(Release::GaveUp);
                return Err(e);
            }
            Err(e) => {
                tracing::debug!(name = %shared.name, error = %e, "release failed; will retry");
                tries.failures = tries.failures.saturating_add(1);
                tries.not_before = e.retry_after().map(|after| Instant::now() + after);
                last = Some(e);
            }
        }
    }
}

/// Sleeps `pause`, or less if an acquire wants the release settled now, or
/// the client goes away meanwhile; but never wakes before `not_before`,
/// when the router said it may be asked again.
async fn pause_for(
    pause: Duration,
    not_before: Option<Instant>,
    shared: &Shared,
    until: &mut Until,
) {
    let sleep = tokio::time::sleep(pause);
    match until {
        Until::ClientGone(gone) if !*gone.borrow() => tokio::select! {
            _ = sleep => {}
            _ = shared.retry_now.notified() => {}
            // An error means the task is gone, which ends this future anyway.
            _ = gone.changed() => {}
        },
        _ => tokio::select! {
            _ = sleep => {}
            _ = shared.retry_now.notified() => {}
        },
    }
    if let Some(at) = not_before {
        tokio::time::sleep_until(at).await;
    }
}

/// The error for a release whose validity was over before any attempt
/// (handed over with failures already counted).
fn unconfirmed(shared: &Shared) -> Error {
    Error::Transport(format!(
        "the release of {:?} was not confirmed within its validity",
        shared.name
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::state::tests::shared;

    const TTL: Duration = Duration::from_secs(30);

    fn unavailable() -> Error {
        Error::Router {
            status: 503,
            code: "shard_unavailable".into(),
            message: "shard a is unavailable".into(),
            retry_after: None,
        }
    }

    /// A 503 `overloaded` asking to come back in `secs` seconds.
    fn overloaded(secs: u64) -> Error {
        Error::Router {
            status: 503,
            code: "overloaded".into(),
            message: "retry after a second".into(),
            retry_after: Some(Duration::from_secs(secs)),
        }
    }

    /// An attempt that fails `fails` times, then succeeds; records when
    /// each attempt came.
    fn scripted(
        fails: usize,
        times: &std::sync::Mutex<Vec<Instant>>,
    ) -> impl FnMut() -> std::future::Ready<Result<(), Error>> + '_ {
        failing_with(fails, unavailable(), times)
    }

    /// [`scripted`], failing with `failure`.
    fn failing_with(
        fails: usize,
        failure: Error,
        times: &std::sync::Mutex<Vec<Instant>>,
    ) -> impl FnMut() -> std::future::Ready<Result<(), Error>> + '_ {
        move || {
            let mut t = times.lock().unwrap();
            t.push(Instant::now());
            std::future::ready(if t.len() > fails {
                Ok(())
            } else {
                Err(failure.clone())
            })
        }
    }

    fn gaps(times: &[Instant]) -> Vec<Duration> {
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn retries_with_growing_backoff_until_the_router_confirms() {
        let s = shared(1, TTL, Duration::from_secs(27));
        let times = std::sync::Mutex::new(Vec::new());
        let r = retry(
            &s,
            scripted(5, &times),
            &mut Tries::default(),
            Until::ValidityEnds,
        )
        .await;
        assert_eq!(r, Ok(()));
        assert_eq!(s.current().release, Release::Done);
        let times = times.into_inner().unwrap();
        assert_eq!(times.len(), 6);
        let gaps = gaps(&times);
        assert!(gaps[0] <= Duration::from_millis(100), "{gaps:?}");
        assert!(gaps.iter().all(|g| *g <= MAX_BACKOFF), "{gaps:?}");
        assert!(gaps[4] >= Duration::from_millis(800), "grows: {gaps:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_is_not_retried() {
        let s = shared(1, TTL, Duration::from_secs(27));
        s.begin_release();
        let mut calls = 0;
        let refuse = || {
            calls += 1;
            std::future::ready(Err(Error::Router {
                status: 400,
                code: "invalid_argument".into(),
                message: "bad lockId".into(),
                retry_after: None,
            }))
        };
        let r = retry(&s, refuse, &mut Tries::default(), Until::ValidityEnds).await;
        assert!(matches!(r, Err(Error::Router { status: 400, .. })));
        assert_eq!(calls, 1);
        assert_eq!(s.current().release, Release::GaveUp);
    }

    #[tokio::test(start_paused = true)]
    async fn an_explicit_release_gives_up_when_validity_ends() {
        let s = shared(1, TTL, Duration::from_secs(10));
        let start = Instant::now();
        let times = std::sync::Mutex::new(Vec::new());
        let mut tries = Tries::default();
        let r = retry(
            &s,
            scripted(usize::MAX, &times),
            &mut tries,
            Until::ValidityEnds,
        )
        .await;
        assert_eq!(r, Err(unavailable()));
        let last = *times.lock().unwrap().last().unwrap();
        assert_eq!(
            last - start,
            Duration::from_secs(10),
            "a last try at the end"
        );
        assert_eq!(Instant::now(), last);
        assert_eq!(tries.failures as usize, times.lock().unwrap().len());
    }

    #[tokio::test(start_paused = true)]
    async fn in_the_background_it_goes_on_past_validity_at_up_to_a_renewal_interval() {
        let s = shared(1, TTL, Duration::from_secs(27));
        let (_gone_tx, gone) = watch::channel(false);
        let times = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = {
            let (s, times) = (s.clone(), times.clone());
            tokio::spawn(async move {
                let attempt = scripted(usize::MAX, &times);
                retry(&s, attempt, &mut Tries::default(), Until::ClientGone(gone)).await
            })
        };
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!task.is_finished(), "still trying ten minutes on");
        let times = times.lock().unwrap().clone();
        let start = times[0];
        let (during, after): (Vec<Instant>, Vec<Instant>) = times
            .iter()
            .partition(|t| **t - start < Duration::from_secs(27));
        assert!(gaps(&during).iter().all(|g| *g <= MAX_BACKOFF));
        let slow = gaps(&after);
        assert!(
            slow.iter().all(|g| *g <= Duration::from_secs(10)),
            "{slow:?}"
        );
        assert!(
            slow.iter()
                .rev()
                .take(5)
                .all(|g| *g >= Duration::from_secs(5)),
            "slower once validity is over: {slow:?}"
        );
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_background_release_hurries_when_the_client_goes_and_stops_at_a_sibling_204() {
        let s = shared(1, TTL, Duration::from_secs(1));
        let (gone_tx, gone) = watch::channel(false);
        let times = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = {
            let (s, times) = (s.clone(), times.clone());
            tokio::spawn(async move {
                let attempt = scripted(usize::MAX, &times);
                retry(&s, attempt, &mut Tries::default(), Until::ClientGone(gone)).await
            })
        };
        // Well into the slow pace (10 s between attempts).
        tokio::time::sleep(Duration::from_secs(120)).await;
        let before = times.lock().unwrap().len();
        gone_tx.send_replace(true);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(times.lock().unwrap().len(), before + 1, "at once");
        tokio::time::sleep(MAX_BACKOFF).await;
        assert!(times.lock().unwrap().len() >= before + 2, "then fast");
        // Another Lock of the grant got the 204: nothing more to do.
        s.end_release(Release::Done);
        let r = tokio::time::timeout(MAX_BACKOFF * 2, task).await;
        assert_eq!(r.expect("stops").unwrap(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_racing_the_release_wakes_it_from_its_backoff() {
        let s = shared(1, TTL, Duration::from_secs(1));
        let (_gone_tx, gone) = watch::channel(false);
        let times = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = {
            let (s, times) = (s.clone(), times.clone());
            tokio::spawn(async move {
                let attempt = scripted(20, &times);
                retry(&s, attempt, &mut Tries::default(), Until::ClientGone(gone)).await
            })
        };
        tokio::time::sleep(Duration::from_secs(60)).await;
        let before = times.lock().unwrap().len();
        s.retry_now.notify_one();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(times.lock().unwrap().len(), before + 1);
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_waits_at_least_the_routers_retry_after() {
        let s = shared(1, TTL, Duration::from_secs(27));
        let times = std::sync::Mutex::new(Vec::new());
        let attempt = failing_with(2, overloaded(3), &times);
        let r = retry(&s, attempt, &mut Tries::default(), Until::ValidityEnds).await;
        assert_eq!(r, Ok(()));
        let times = times.into_inner().unwrap();
        assert_eq!(times.len(), 3);
        let gaps = gaps(&times);
        assert!(
            gaps.iter().all(|g| *g >= Duration::from_secs(3)),
            "not before the router asked: {gaps:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_explicit_release_stops_when_retry_after_would_pass_validity() {
        let s = shared(1, TTL, Duration::from_secs(2));
        let start = Instant::now();
        let times = std::sync::Mutex::new(Vec::new());
        let attempt = failing_with(usize::MAX, overloaded(5), &times);
        let mut tries = Tries::default();
        let r = retry(&s, attempt, &mut tries, Until::ValidityEnds).await;
        assert_eq!(r, Err(overloaded(5)), "the router's answer, hint and all");
        assert_eq!(times.lock().unwrap().len(), 1, "no attempt fits");
        assert_eq!(Instant::now(), start, "returned at once");
        assert_eq!(
            tries.not_before,
            Some(start + Duration::from_secs(5)),
            "kept for the renewal task"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handed_over_release_keeps_the_retry_after() {
        let s = shared(1, TTL, Duration::from_secs(27));
        let (_gone_tx, gone) = watch::channel(false);
        let start = Instant::now();
        let mut tries = Tries {
            failures: 1,
            not_before: Some(start + Duration::from_secs(3)),
        };
        let times = std::sync::Mutex::new(Vec::new());
        let r = retry(&s, scripted(0, &times), &mut tries, Until::ClientGone(gone)).await;
        assert_eq!(r, Ok(()));
        let first = times.lock().unwrap()[0];
        assert!(
            first - start >= Duration::from_secs(3),
            "{:?}",
            first - start
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_acquire_waking_the_release_does_not_cut_its_retry_after_short() {
        let s = shared(1, TTL, Duration::from_secs(27));
        let (_gone_tx, gone) = watch::channel(false);
        let times = Arc::new(std::sync::Mutex::new(Vec::new()));
        let task = {
            let (s, times) = (s.clone(), times.clone());
            tokio::spawn(async move {
                let attempt = failing_with(1, overloaded(3), &times);
                retry(&s, attempt, &mut Tries::default(), Until::ClientGone(gone)).await
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(times.lock().unwrap().len(), 1);
        s.retry_now.notify_one();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(task.await.unwrap(), Ok(()));
        let gaps = gaps(&times.lock().unwrap());
        assert_eq!(gaps.len(), 1);
        assert!(gaps[0] >= Duration::from_secs(3), "{gaps:?}");
    }
}
