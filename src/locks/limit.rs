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

use super::LockError;

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

    /// Counts one acquire of `client`, or refuses it.
    pub fn check(&self, client: &str) -> Result<(), LockError> {
        if self.checks.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.limiter.retain_recent();
            self.limiter.shrink_to_fit();
        }
        self.limiter
            .check_key(&client.to_string())
            .map_err(|not_until| {
                let wait = not_until.wait_time_from(self.clock.now());
                LockError::RateLimited {
                    reason: format!(
                        "clientId {client:?} is past {} acquires/s; retry in {} ms",
                        self.per_sec,
                        wait.as_millis().max(1)
                    ),
                    retry_after: wait.max(Duration::from_secs(1)),
                }
            })
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
        match limiter.check("busy") {
            Err(LockError::RateLimited {
                reason,
                retry_after,
            }) => {
                assert!(reason.contains("\"busy\" is past 5 acquires/s"), "{reason}");
                assert!(retry_after >= Duration::from_secs(1));
            }
            other => panic!("not refused: {other:?}"),
        }
        limiter
            .check("calm")
            .expect("another client has its own rate");
        assert_eq!(limiter.remembered(), 2);
        assert!(ClientLimiter::new(0).is_none(), "0 means no limit");
    }
}
