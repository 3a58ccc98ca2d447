//! The validity clock: how long the client may trust a lock, judged only by
//! its own monotonic clock.
//!
//! `valid_until = instant taken just before sending + expiresInMs − margin`.
//! The router's `expiresInMs` never overstates the lease (it counts from
//! when the router asked etcd), and the instant is taken before the request
//! left, so network and queueing delays only make the estimate earlier. The
//! margin absorbs clock-rate differences between machines and the time the
//! caller needs to act on a lost lock. The wall-clock `expiresAt` is never
//! used: wall clocks jump.

use std::time::Duration;

use tokio::time::Instant;

/// The smallest margin ever used, whatever the TTL or configuration.
pub const MIN_MARGIN: Duration = Duration::from_millis(100);

/// The safety margin for a lock of `ttl`: the configured one, else ttl/10,
/// never below [`MIN_MARGIN`].
pub fn margin(ttl: Duration, configured: Option<Duration>) -> Duration {
    configured.unwrap_or(ttl / 10).max(MIN_MARGIN)
}

/// The moment until which a lock confirmed by an answer to a request sent
/// at `sent_at` may be trusted.
pub fn valid_until(sent_at: Instant, expires_in: Duration, margin: Duration) -> Instant {
    sent_at + expires_in.saturating_sub(margin)
}

/// How often held locks are renewed: a third of the TTL, so two renewals
/// can fail before validity runs out.
pub fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(50))
}

/// When to renew a lock confirmed at `confirmed_at`: an interval later, or
/// earlier if less than an interval of validity would be left by then (a
/// grant after a long wait, or a router reporting a short lease).
pub fn next_renewal(confirmed_at: Instant, valid_until: Instant, interval: Duration) -> Instant {
    let regular = confirmed_at + interval;
    match valid_until.checked_sub(interval) {
        Some(early) => regular.min(early.max(confirmed_at)),
        None => confirmed_at,
    }
}

/// Longest pause between retries of a failed renewal, or of a release
/// while the lock is still valid.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The pause before retry number `failures` (1-based) of a failed renewal
/// or release: exponential from 100 ms, capped at `cap`, with full jitter in
/// the upper half so many clients of a recovering router do not retry in
/// step.
pub fn backoff(failures: u32, cap: Duration) -> Duration {
    let exp = Duration::from_millis(100).saturating_mul(1 << failures.saturating_sub(1).min(16));
    let top = exp.min(cap).max(Duration::from_millis(10));
    let ms = top.as_millis() as u64;
    Duration::from_millis(fastrand::u64(ms / 2..=ms))
}

/// The pause before retry number `failures` of a failed renewal whose
/// answer asked for `retry_after` (the router's `Retry-After`): the
/// [`backoff`], or the router's wait when that is longer and fits the
/// schedule: no longer than `cap` (the longest pause the backoff takes
/// anyway) and over before the lock's validity, `left`, runs out. A wait
/// that does not fit is not taken at all: the plain backoff keeps the
/// renewals a lock's validity was planned around, and the router keeps a
/// share of its capacity for renewals, which no surge of acquires takes.
pub fn renewal_pause(
    failures: u32,
    cap: Duration,
    retry_after: Option<Duration>,
    left: Duration,
) -> Duration {
    let pause = backoff(failures, cap);
    match retry_after {
        Some(asked) if asked <= cap && asked < left => pause.max(asked),
        _ => pause,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_defaults_to_a_tenth_of_the_ttl_and_never_below_100ms() {
        assert_eq!(
            margin(Duration::from_secs(30), None),
            Duration::from_secs(3)
        );
        assert_eq!(margin(Duration::from_millis(500), None), MIN_MARGIN);
        assert_eq!(
            margin(Duration::from_secs(30), Some(Duration::from_secs(1))),
            Duration::from_secs(1)
        );
        assert_eq!(
            margin(Duration::from_secs(30), Some(Duration::ZERO)),
            MIN_MARGIN
        );
    }

    #[tokio::test(start_paused = true)]
    async fn validity_counts_from_before_sending_not_from_the_answer() {
        let sent_at = Instant::now();
        // The answer takes 2 s to arrive (paused time advances only here).
        tokio::time::sleep(Duration::from_secs(2)).await;
        let until = valid_until(sent_at, Duration::from_secs(10), Duration::from_secs(1));
        assert_eq!(until, sent_at + Duration::from_secs(9));
        assert_eq!(until - Instant::now(), Duration::from_secs(7));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_shorter_than_the_margin_is_already_invalid() {
        let sent_at = Instant::now();
        let until = valid_until(sent_at, Duration::from_millis(50), MIN_MARGIN);
        assert!(until <= Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_come_every_interval_or_sooner_when_validity_is_short() {
        let now = Instant::now();
        let interval = Duration::from_secs(10);
        // A fresh 30 s lock (27 s valid): the regular third of the TTL.
        let fresh = next_renewal(now, now + Duration::from_secs(27), interval);
        assert_eq!(fresh, now + interval);
        // 12 s left (a long wait ate the rest): renew 2 s from now.
        let short = next_renewal(now, now + Duration::from_secs(12), interval);
        assert_eq!(short, now + Duration::from_secs(2));
        // Less than an interval left: renew at once.
        let urgent = next_renewal(now, now + Duration::from_secs(3), interval);
        assert_eq!(urgent, now);
    }

    #[test]
    fn backoff_grows_and_stays_under_its_cap() {
        let cap = Duration::from_secs(1);
        for failures in 1..40 {
            let b = backoff(failures, cap);
            assert!(b <= cap, "{b:?}");
        }
        assert!(backoff(1, cap) <= Duration::from_millis(100));
        assert!(backoff(10, cap) >= Duration::from_millis(500));
    }

    #[test]
    fn a_renewal_waits_for_retry_after_only_within_its_cap_and_validity() {
        let cap = Duration::from_secs(2);
        let left = Duration::from_secs(20);
        let second = Duration::from_secs(1);
        for failures in 1..6 {
            let pause = renewal_pause(failures, cap, Some(second), left);
            assert!(pause >= second, "{failures}: {pause:?}");
            assert!(pause <= cap, "{failures}: {pause:?}");
        }
        let first_backoff = Duration::from_millis(100);
        let longer_than_the_cap = Some(Duration::from_secs(5));
        assert!(renewal_pause(1, cap, longer_than_the_cap, left) <= first_backoff);
        let validity_nearly_over = Duration::from_millis(900);
        assert!(renewal_pause(1, cap, Some(second), validity_nearly_over) <= first_backoff);
        assert!(renewal_pause(1, cap, None, left) <= first_backoff);
    }
}
