//! The grant cut-off (its marks `P/cutoff/<n>`): every acquire txn
//! compares that no mark above the one its router last saw exists, and a
//! router whose grant txn went unanswered puts the next mark, so that the
//! txn grants nothing if it lands later (`docs/design.md`, "An acquire
//! that was not answered").

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{DeleteOptions, Txn, TxnOp};

use super::conn::{EtcdConn, EtcdError};
use super::keys::Keys;

/// How long a move that failed at once waits before it is sent again.
const AGAIN_AFTER: Duration = Duration::from_millis(100);

/// The grant cut-off as a replica knows it: the highest mark it last saw,
/// and one move at a time.
#[derive(Default)]
pub struct Cutoff {
    seen: AtomicI64,
    moving: tokio::sync::Mutex<()>,
    /// Moves that failed so far.
    failed: AtomicU64,
}

impl Cutoff {
    /// The cut-off last seen.
    pub fn seen(&self) -> i64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Keeps `mark`, read from the shard, as the cut-off. Not only a
    /// larger one: a shard restored from a snapshot may go back, and its
    /// grants compare what it holds. An older read kept by a race costs
    /// one refused txn, which reads the cut-off again; it never skips a
    /// move that is needed ([`Cutoff::move_past`]).
    pub fn learn(&self, mark: i64) {
        self.seen.store(mark, Ordering::Release);
    }

    /// Puts the mark above `compared` (and above the last seen) and deletes
    /// those below it, unless a mark above `compared` was seen since. The
    /// txn is hedged: running it twice puts the same mark again. A mark
    /// seen above `compared` existed at some moment, and a move deletes
    /// only marks below the one it puts, so one at least as high exists
    /// from then on: a txn comparing `compared` can never be applied, and
    /// needs no move. The move is sent again, after a failure that came
    /// early, within one deadline of the shard in all. A caller that
    /// waited for its turn while a move failed fails at once, unmoved: the
    /// shard answered nobody just then.
    pub async fn move_past(
        &self,
        conn: &EtcdConn,
        keys: &Keys,
        compared: i64,
    ) -> Result<(), EtcdError> {
        let failed = self.failed.load(Ordering::Acquire);
        let _turn = self.moving.lock().await;
        let seen = self.seen();
        if seen > compared {
            return Ok(());
        }
        if self.failed.load(Ordering::Acquire) != failed {
            // A move failed while this one waited for its turn: the shard
            // answered nobody a moment ago, and trying again would keep
            // each caller queued here one more deadline.
            conn.metrics().cutoff_moved(false);
            return Err(conn.unavailable("the grant cut-off could not be moved just now"));
        }
        let mark = seen.max(compared).saturating_add(1);
        let (first, _) = keys.cutoff_marks();
        let key = keys.cutoff_mark(mark);
        let below = DeleteOptions::new().with_range(key.clone());
        let txn = Txn::new().and_then([
            TxnOp::put(key, Vec::<u8>::new(), None),
            TxnOp::delete(first, Some(below)),
        ]);
        // Sent again while one deadline lasts: a move that failed at once
        // met a connection just broken (a shard of one endpoint drops its
        // connection when a pause outlasts its pings), and the next one
        // is a fresh connection.
        let until = Instant::now() + conn.timeout();
        let moved = loop {
            let left = until.saturating_duration_since(Instant::now());
            let moved = tokio::time::timeout(left, conn.txn_hedged(txn.clone()))
                .await
                .unwrap_or_else(|_| Err(conn.unavailable("the move had no answer in time")));
            if moved.is_ok() || Instant::now() + AGAIN_AFTER >= until {
                break moved;
            }
            tokio::time::sleep(AGAIN_AFTER).await;
        };
        match &moved {
            Ok(_) => {
                self.seen.fetch_max(mark, Ordering::AcqRel);
                // A write the shard committed: it has a leader and a
                // quorum, whatever the monitor's last probe said, and the
                // acquire asks again there at once.
                conn.set_up(true);
                tracing::info!(
                    shard = %conn.shard(),
                    mark,
                    "a grant txn went unanswered: the grant cut-off moved past it"
                );
            }
            Err(e) => {
                self.failed.fetch_add(1, Ordering::AcqRel);
                tracing::warn!(
                    shard = %conn.shard(),
                    error = %e,
                    "a grant txn went unanswered, and the grant cut-off could not be moved"
                )
            }
        }
        conn.metrics().cutoff_moved(moved.is_ok());
        moved.map(|_| ())
    }
}
