//! What a renewal asks of a shard: that each lock key still be its
//! lockId's (the lock-key cache of [`cache`] after a barrier, or the
//! batched linearizable reads of [`verify`] when the cache cannot vouch),
//! and a keepalive of each session lease a lock was verified on; and how
//! long that took, which makes the shard shed acquires when renewals are
//! slow ([`pressure`]). Which leases get a keepalive, how soon, and what
//! each lock's answer is, is the lock layer's (`locks/renew.rs`).
//!
//! [`cache`]: super::cache
//! [`verify`]: super::verify
//! [`pressure`]: super::pressure

use std::time::{Duration, Instant};

use futures::future::join_all;

use super::cache::{Entry, Vouched};
use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::keys::NameHash;
use super::Shard;

impl Shard {
    /// The (create revision, lease) of the lock key of each of `hashes`, or
    /// `None` if it is gone, as of a moment after this call began: the
    /// lock-key cache's entries after one barrier, or, when it cannot
    /// vouch, linearizable reads of the keys.
    pub async fn lock_entries(&self, hashes: &[NameHash]) -> Vec<Result<Option<Entry>, EtcdError>> {
        match self.cache.lookup(hashes).await {
            Ok(Vouched::Entries(entries)) => {
                self.metrics().renewal_check("cache", hashes.len());
                entries.into_iter().map(Ok).collect()
            }
            Err(e) => vec![Err(e); hashes.len()],
            Ok(Vouched::Unsure) => {
                self.metrics().renewal_check("read", hashes.len());
                let reads = hashes
                    .iter()
                    .map(|hash| self.verifier.get(self.keys.lock(hash)));
                join_all(reads)
                    .await
                    .into_iter()
                    .map(|r| r.map(|kv| kv.map(|kv| (kv.create_revision(), kv.lease()))))
                    .collect()
            }
        }
    }

    /// A lock renewal's keepalive of the session lease `lease`, which the
    /// lock was just verified on: as [`Shard::renew_lease`], but a keepalive
    /// it sends may wait for the next burst (renewals come every third of a
    /// TTL and do not notice). A lease found alive counts as kept alive by
    /// its client's renewals, which keeps its session cached
    /// ([`Shard::sweep_sessions`]).
    pub async fn renew_session(
        &self,
        lease: i64,
        window: Duration,
        ttl_secs: u32,
    ) -> Result<Renewal, EtcdError> {
        let renewal = self
            .keepalive
            .refresh_in_burst(lease, window, ttl_secs)
            .await;
        if matches!(renewal, Ok(r) if r.alive()) {
            self.sessions.touch(lease);
        }
        renewal
    }

    /// A renewal (or a renew-batch's part) on this shard took `took`,
    /// against the `budget` renewals have: true if that made the shard
    /// start shedding acquires ([`Shard::admit_acquire`]).
    pub fn note_renewal(&self, took: Duration, budget: Duration, now: Instant) -> bool {
        self.pressure.renewal(took, budget, now)
    }
}
