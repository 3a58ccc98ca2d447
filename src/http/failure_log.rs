//! The log of failed requests. Each failure is logged on its own line, with
//! its request id, while failures are few: that is how an operator finds
//! the call a client saw fail. A storm of them would be a line each,
//! costing CPU when the router can least spare it and burying every other
//! line, so each kind of failure has a [`Throttle`]: at most so many lines
//! a second (as many at once after a quiet spell), each counting the
//! failures left out since the last.
//!
//! - Requests shed as 503 `overloaded`: one line a second. Shedding
//!   refuses them by the thousand exactly when the router is busiest (a
//!   line each took 6.5 % of its CPU under twice its capacity).
//! - Every other 5xx: [`FAILED_LINES_PER_SEC`] lines a second for each
//!   outcome (a shard down answers each of its requests
//!   `shard_unavailable`, thousands a second).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

/// Lines a second about requests shed as `overloaded`.
pub const SHED_LINES_PER_SEC: u32 = 1;
/// Lines a second each other failure outcome may log, and how many may
/// come at once after a quiet spell.
pub const FAILED_LINES_PER_SEC: u32 = 10;

/// Lines of one kind: at most so many a second, each counting those left
/// out since the last.
pub struct Throttle {
    lines: DefaultDirectRateLimiter,
    left_out: AtomicU64,
}

impl Throttle {
    pub fn new(lines_per_sec: u32) -> Self {
        let per_sec = NonZeroU32::new(lines_per_sec).unwrap_or(NonZeroU32::MIN);
        Self {
            lines: RateLimiter::direct(Quota::per_second(per_sec)),
            left_out: AtomicU64::new(0),
        }
    }

    /// Counts one event. `Some(n)` when it is to be logged, `n` being the
    /// events left out since the last line (0 while they are few); `None`
    /// when it is left out. An event counted while another's line is being
    /// let through goes in that line or the next, never in none.
    pub fn hit(&self) -> Option<u64> {
        if self.lines.check().is_ok() {
            Some(self.left_out.swap(0, Ordering::AcqRel))
        } else {
            self.left_out.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

/// Says which failed requests get a line of their own.
pub struct FailureLog {
    /// Requests shed as `overloaded`.
    pub shed: Throttle,
    /// Every other 5xx, by outcome.
    failures: RwLock<HashMap<&'static str, Throttle>>,
}

impl Default for FailureLog {
    fn default() -> Self {
        Self {
            shed: Throttle::new(SHED_LINES_PER_SEC),
            failures: RwLock::default(),
        }
    }
}

impl FailureLog {
    /// Counts one failure with `outcome` (not `overloaded`: see
    /// [`FailureLog::shed`]), as [`Throttle::hit`] does.
    pub fn failed(&self, outcome: &'static str) -> Option<u64> {
        if let Some(throttle) = self.failures.read().expect("failure log").get(outcome) {
            return throttle.hit();
        }
        let mut failures = self.failures.write().expect("failure log");
        failures
            .entry(outcome)
            .or_insert_with(|| Throttle::new(FAILED_LINES_PER_SEC))
            .hit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_its_first_lines_then_counts_the_rest_for_the_next() {
        let throttle = Throttle::new(3);
        let logged: Vec<_> = (0..50).map(|_| throttle.hit()).collect();
        let lines = logged.iter().filter(|l| l.is_some()).count();
        // Three at once; the burst takes far less than the third of a
        // second that would let a fourth through.
        assert_eq!(lines, 3, "{logged:?}");
        assert!(logged[..3].iter().all(|l| *l == Some(0)), "{logged:?}");
        std::thread::sleep(std::time::Duration::from_millis(400));
        assert_eq!(
            throttle.hit(),
            Some(47),
            "the next line counts what was left out"
        );
        assert_eq!(throttle.hit(), None);
    }

    #[test]
    fn shedding_gets_one_line_a_second() {
        let log = FailureLog::default();
        assert_eq!(log.shed.hit(), Some(0), "the first is logged at once");
        assert!((0..100).all(|_| log.shed.hit().is_none()));
        std::thread::sleep(std::time::Duration::from_millis(1_050));
        assert_eq!(log.shed.hit(), Some(100), "a second later, with the count");
    }

    #[test]
    fn each_outcome_has_lines_of_its_own() {
        let log = FailureLog::default();
        for _ in 0..FAILED_LINES_PER_SEC {
            assert_eq!(log.failed("shard_unavailable"), Some(0));
        }
        assert_eq!(log.failed("shard_unavailable"), None);
        assert_eq!(log.failed("internal"), Some(0));
        assert_eq!(log.shed.hit(), Some(0), "shedding has its own too");
    }

    #[test]
    fn racing_failures_are_each_logged_or_counted_once() {
        let throttle = Throttle::new(5);
        let (lines, counted): (u64, u64) = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..1_000).fold((0, 0), |(lines, counted), _| match throttle.hit() {
                            Some(n) => (lines + 1, counted + n),
                            None => (lines, counted),
                        })
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
        });
        let pending = throttle.left_out.load(Ordering::Acquire);
        assert!(lines >= 5, "{lines}");
        assert_eq!(lines + counted + pending, 4_000);
    }
}
