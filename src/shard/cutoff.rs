//! The grant cut-off (`P/cutoff`): every acquire txn compares its mod
//! revision, and a router whose grant txn went unanswered moves it, so
//! that the txn grants nothing if it lands later (`docs/design.md`, "An
//! acquire that was not answered").

use std::sync::atomic::{AtomicI64, Ordering};

use super::conn::{EtcdConn, EtcdError};

/// The grant cut-off (`P/cutoff`) as a replica knows it: the mod revision
/// it last saw, and one move at a time.
#[derive(Default)]
pub struct Cutoff {
    seen: AtomicI64,
    moving: tokio::sync::Mutex<()>,
}

impl Cutoff {
    /// The cut-off last seen.
    pub fn seen(&self) -> i64 {
        self.seen.load(Ordering::Acquire)
    }

    /// Keeps `revision`, read from the shard, as the cut-off. Not only a
    /// larger one: a shard restored from a snapshot may go back, and its
    /// grants compare what it holds. An older read kept by a race costs
    /// one refused txn, which reads the cut-off again; it never skips a
    /// move that is needed ([`Cutoff::move_past`]).
    pub fn learn(&self, revision: i64) {
        self.seen.store(revision, Ordering::Release);
    }

    /// Puts `key` unless a move past `compared` was seen since; the put is
    /// hedged (running it twice moves the cut-off twice, which is as good).
    /// A cut-off seen above `compared` is one the key had at some moment,
    /// and its mod revision only grows from there: a txn comparing
    /// `compared` can never be applied, and needs no move.
    pub async fn move_past(
        &self,
        conn: &EtcdConn,
        key: Vec<u8>,
        compared: i64,
    ) -> Result<(), EtcdError> {
        let _turn = self.moving.lock().await;
        if self.seen() > compared {
            return Ok(());
        }
        let put = conn.call_hedged("Put", |client| {
            let key = key.clone();
            async move { client.kv_client().put(key, Vec::<u8>::new(), None).await }
        });
        let result = put.await;
        let moved = (result.as_ref()).map(|resp| resp.header().map_or(0, |h| h.revision()));
        match moved {
            Ok(revision) => {
                self.seen.fetch_max(revision, Ordering::AcqRel);
                tracing::info!(
                    shard = %conn.shard(),
                    revision,
                    "a grant txn went unanswered: the grant cut-off moved past it"
                );
            }
            Err(e) => tracing::warn!(
                shard = %conn.shard(),
                error = %e,
                "a grant txn went unanswered, and the grant cut-off could not be moved"
            ),
        }
        conn.metrics().cutoff_moved(moved.is_ok());
        result.map(|_| ())
    }
}
