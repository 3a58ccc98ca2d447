//! The log of failed requests (5xx other than shedding, which
//! [`ShedLog`](super::admission::ShedLog) counts). Each failure is logged
//! on its own line, with its request id, while failures are few: that is
//! how an operator finds the call a client saw fail. A storm of them (a
//! shard down, its every request answered `shard_unavailable`, thousands a
//! second) would be a line each, costing CPU when the router can least
//! spare it and burying every other line. So each outcome gets at most
//! [`FAILED_LINES_PER_SEC`] lines a second (as many at once after a quiet
//! spell); past that, failures are counted and the next line of that
//! outcome says how many were left out (`suppressed`).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Mutex;

use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// Lines a second each failure outcome may log, and how many may come at
/// once after a quiet spell.
pub const FAILED_LINES_PER_SEC: u32 = 10;

/// Says which failed requests get a line of their own.
pub struct FailureLog {
    lines: DefaultKeyedRateLimiter<&'static str>,
    /// Failures of each outcome left out since its last line.
    suppressed: Mutex<HashMap<&'static str, u64>>,
}

impl Default for FailureLog {
    fn default() -> Self {
        Self::new(FAILED_LINES_PER_SEC)
    }
}

impl FailureLog {
    pub fn new(lines_per_sec: u32) -> Self {
        let per_sec = NonZeroU32::new(lines_per_sec).unwrap_or(NonZeroU32::MIN);
        Self {
            lines: RateLimiter::keyed(Quota::per_second(per_sec)),
            suppressed: Mutex::new(HashMap::new()),
        }
    }

    /// Counts one failure with `outcome`. `Some(n)` when it is to be
    /// logged, `n` being the failures of that outcome left out since its
    /// last line (0 while they are few); `None` when it is left out.
    pub fn failed(&self, outcome: &'static str) -> Option<u64> {
        let mut suppressed = self.suppressed.lock().expect("failure log");
        if self.lines.check_key(&outcome).is_ok() {
            Some(suppressed.remove(outcome).unwrap_or(0))
        } else {
            *suppressed.entry(outcome).or_default() += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_its_first_lines_then_counts_the_rest_for_the_next() {
        let log = FailureLog::new(3);
        let logged: Vec<_> = (0..50).map(|_| log.failed("shard_unavailable")).collect();
        let lines = logged.iter().filter(|l| l.is_some()).count();
        // Three at once; the burst takes far less than the third of a
        // second that would let a fourth through.
        assert_eq!(lines, 3, "{logged:?}");
        assert!(logged[..3].iter().all(|l| *l == Some(0)), "{logged:?}");
        // Another outcome has lines of its own.
        assert_eq!(log.failed("internal"), Some(0));
        std::thread::sleep(std::time::Duration::from_millis(400));
        assert_eq!(
            log.failed("shard_unavailable"),
            Some(47),
            "the next line counts what was left out"
        );
        assert_eq!(log.failed("internal"), Some(0));
    }

    #[test]
    fn racing_failures_are_each_logged_or_counted_once() {
        let log = FailureLog::new(5);
        let (lines, counted): (u64, u64) = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..1_000).fold((0, 0), |(lines, counted), _| match log.failed("x") {
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
        let pending = log
            .suppressed
            .lock()
            .unwrap()
            .get("x")
            .copied()
            .unwrap_or(0);
        assert!(lines >= 5, "{lines}");
        assert_eq!(lines + counted + pending, 4_000);
    }
}
