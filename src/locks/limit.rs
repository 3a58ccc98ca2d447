//! Per-client acquire rate limits: each clientId may start at most
//! `limits.acquires_per_client_per_sec` acquires a second (bursts of as
//! many), so one runaway client cannot take the shards' grant capacity
//! from the others. Past it, 429 `rate_limited` with the time until the
//! next acquire is allowed in `Retry-After`. Renewals and releases are
//! never limited: they keep held locks alive and free names.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Checks between two sweeps of clients idle long enough to have their
/// full burst back (which the limiter then forgets).
const SWEEP_EVERY: u64 = 10_000;

pub struct ClientLimiter {
    limiter: DefaultKeyedRateLimiter<String>,
    clock: DefaultClock,
    per_sec: NonZeroU32,
    checks: AtomicU64,
}

impl ClientLimiter {
    /// `None` when `per_sec` is 0 (no limit).
    pub fn new(per_sec: u32) -> Option<Self> {
        let per_sec = NonZeroU32::new(per_sec)?;
        Some(Self {
            limiter: RateLimiter::keyed(Quota::per_second(per_sec)),
            clock: DefaultClock::default(),
            per_sec,
            checks: AtomicU64::new(0),
        })
    }

    /// Counts one acquire of `client`, or refuses it with the time until
    /// its next acquire is allowed.
    pub fn check(&self, client: &str) -> Result<(), Duration> {
        if self.checks.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.limiter.retain_recent();
            self.limiter.shrink_to_fit();
        }
        self.limiter
            .check_key(&client.to_string())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// The acquires per second each client may start.
    pub fn per_sec(&self) -> u32 {
        self.per_sec.get()
    }

    /// Clients the limiter remembers (for tests).
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.limiter.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_past_its_rate_is_refused_and_others_are_not() {
        let limiter = ClientLimiter::new(5).expect("limited");
        for _ in 0..5 {
            limiter.check("busy").expect("within the burst");
        }
        let wait = limiter.check("busy").expect_err("past the burst");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(200),
            "{wait:?}"
        );
        assert_eq!(limiter.per_sec(), 5);
        limiter
            .check("calm")
            .expect("another client has its own rate");
        assert_eq!(limiter.remembered(), 2);
        assert!(ClientLimiter::new(0).is_none(), "0 means no limit");
    }
}
