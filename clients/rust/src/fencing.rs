//! Fencing for resource owners: how the protected resource (a database, a
//! service, a file store) makes a lock safe.
//!
//! A lock alone is never safe. The holder can pause (GC, swap, VM
//! migration, `SIGSTOP`) after checking [`Lock::is_held`](crate::Lock::is_held)
//! and before its write lands; meanwhile its lease expires and another
//! worker gets the lock. When the first one resumes, its write arrives late.
//! The only defence is at the resource: every grant of a name carries a
//! fencing token larger than every earlier grant's, each write carries the
//! token it was made under, and the resource remembers the highest token it
//! has accepted and **atomically** rejects writes with a lower one.
//!
//! # The pattern in SQL
//!
//! Keep the highest accepted token next to the data (a `fence BIGINT`
//! column; tokens fit a signed 64-bit integer) and make the write itself
//! conditional, in one statement, so check and write cannot be separated:
//!
//! ```sql
//! UPDATE orders SET status = $status, fence = $token
//!  WHERE id = $id AND fence <= $token;
//! -- 1 row changed: accepted. 0 rows: a newer holder has written; stop.
//! ```
//!
//! For a row that may not exist yet, create it with `fence = 0` first
//! (`INSERT ... ON CONFLICT DO NOTHING`) in the same transaction. The SQLite
//! example (`examples/fenced_worker`) does exactly this.
//!
//! # Why `<=` and not `<`
//!
//! `fence <= $token` lets the current holder write many times under one
//! grant (every write of a batch job carries the same token) and makes a
//! retried write (after a timeout, or after an idempotent re-acquire, which
//! returns the same token) succeed. Use `fence < $token` only when each
//! grant may write exactly once: the first write under a token then fences
//! out every later write with that same token, including the holder's own.
//! Either way a lower token is always rejected, which is the safety part.
//!
//! # Elsewhere
//!
//! - A key-value store with compare-and-set (etcd, Redis with a script,
//!   DynamoDB conditions): store the fence beside the value and compare in
//!   the same transaction. etcd compares values as bytes, so use
//!   [`fence_key_value`], whose fixed width makes byte order numeric order:
//!   `If(Value(fence_key) <= fence_key_value(t)) Then(Put(data), Put(fence_key, fence_key_value(t)))`.
//! - An HTTP service you own: send the token in a header ([`HEADER`]) and
//!   check it where the write commits, not at the door.
//! - Inside one process (tests, an in-memory resource): [`Fence`].

use std::sync::atomic::{AtomicU64, Ordering};

/// The HTTP header this project uses to pass a fencing token to a service.
pub const HEADER: &str = "Lockrouter-Fencing-Token";

/// A write carried a token lower than one the resource already accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {token}: the resource has accepted {highest}")]
pub struct Stale {
    /// The token the write carried.
    pub token: u64,
    /// The highest token the resource had accepted.
    pub highest: u64,
}

/// Whether a write with `token` may proceed when the resource has accepted
/// `highest` so far (`None`: never written). Equal tokens are admitted: the
/// same grant may write again.
///
/// ```
/// use lockrouter_client::fencing::admits;
/// assert!(admits(None, 7));
/// assert!(admits(Some(7), 7));
/// assert!(admits(Some(7), 9));
/// assert!(!admits(Some(9), 7));
/// ```
pub fn admits(highest: Option<u64>, token: u64) -> bool {
    highest.is_none_or(|h| token >= h)
}

/// The token as a SQL `BIGINT` / Java `long`. Tokens from lockrouter always
/// fit; `None` only for a value that did not come from a router.
///
/// ```
/// assert_eq!(lockrouter_client::fencing::as_i64(4711), Some(4711));
/// assert_eq!(lockrouter_client::fencing::as_i64(u64::MAX), None);
/// ```
pub fn as_i64(token: u64) -> Option<i64> {
    i64::try_from(token).ok()
}

/// The token as 20 zero-padded decimal digits, so that comparing the bytes
/// (as etcd's value compares do) orders tokens numerically.
///
/// ```
/// use lockrouter_client::fencing::fence_key_value;
/// assert_eq!(fence_key_value(42), "00000000000000000042");
/// assert!(fence_key_value(9) < fence_key_value(10));
/// ```
pub fn fence_key_value(token: u64) -> String {
    format!("{token:020}")
}

/// An in-memory fence: the highest token accepted so far, advanced
/// atomically. For resources that live in one process.
///
/// ```
/// use lockrouter_client::fencing::Fence;
/// let fence = Fence::new();
/// assert!(fence.admit(5).is_ok());
/// assert!(fence.admit(5).is_ok()); // the same grant writes again
/// assert!(fence.admit(8).is_ok()); // a newer grant
/// assert_eq!(fence.admit(5).unwrap_err().highest, 8); // the old one is fenced out
/// ```
#[derive(Debug, Default)]
pub struct Fence {
    highest: AtomicU64,
}

impl Fence {
    /// A fence that has accepted nothing (every real token is above 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `token` and raises the fence to it, or rejects it if a
    /// higher token was already accepted. Do the protected write only
    /// after `Ok`, and under the same mutual exclusion as this call if the
    /// write itself is not atomic with it.
    pub fn admit(&self, token: u64) -> Result<(), Stale> {
        self.highest
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                (token >= h).then_some(token)
            })
            .map(|_| ())
            .map_err(|highest| Stale { token, highest })
    }

    /// The highest token accepted so far (0 if none).
    pub fn highest(&self) -> u64 {
        self.highest.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_is_monotonic_under_contention() {
        let fence = std::sync::Arc::new(Fence::new());
        let threads: Vec<_> = (1..=8u64)
            .map(|t| {
                let fence = fence.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        let _ = fence.admit(t * 1000 + i);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fence.highest(), 8999);
        assert!(fence.admit(8998).is_err());
    }

    #[test]
    fn fixed_width_values_sort_like_numbers() {
        let mut tokens = [3u64, 1 << 47, 10, 999, i64::MAX as u64];
        let mut as_text: Vec<String> = tokens.iter().map(|t| fence_key_value(*t)).collect();
        tokens.sort_unstable();
        as_text.sort();
        let back: Vec<u64> = as_text.iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(back, tokens);
    }
}
