//! Renew and renew-batch: a check that each key still has its lockId's
//! create revision and lease, answered by the shard's lock-key cache after a
//! barrier (or by linearizable reads when the cache cannot vouch), then a
//! coalesced keepalive of each lease a lock was verified on; a lock found
//! gone is answered without a keepalive.

use std::time::Instant;

// A request's own small maps (its seals, shards and leases, at most one
// entry per lock of the request): keyed by what opened lockIds carry, so
// a fast seeded hash, not SipHash.
use foldhash::HashMap;

use futures::future::join_all;

use super::*;
use crate::metrics::{Latency, ShardOp};
use crate::shard::conn::EtcdError;
use crate::shard::ops::LockShard;
use crate::shard::{Entry, Renewal, Shard};
use crate::token::lock_id::LockId;

impl Active {
    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<RenewOutcome, LockError> {
        let id = self.open(lock_id, token, caller)?;
        if let Some(ttl_ms) = ttl_ms {
            if self.ttl(ttl_ms)?.secs() != id.ttl_secs {
                return Err(invalid(format!(
                    "ttlMs {ttl_ms} does not match the lock's TTL of {} s: a lock's TTL is fixed when it is acquired",
                    id.ttl_secs
                )));
            }
        }
        // A shard no longer in any ring was drained: the lock is gone.
        let shard = self.shard_of(&id)?;
        let _latency = shard.metrics().latency(ShardOp::Renew, received);
        check_up(&shard)?;
        // A renew that names its TTL asks for the lease renewed now (an
        // SDK's `extend`): a keepalive unless one was confirmed within the
        // coalescing window, whatever is left of the lease.
        let extend = ttl_ms.is_some();
        let mut outcomes = self.renew_on(&*shard, &[&id], extend).await;
        Ok(outcomes.pop().expect("one outcome per lock")?)
    }

    /// Renews every lock in `locks`; malformed entries fail the whole call
    /// (a client only sends lockIds it was given), shard outages only theirs.
    /// The batch's latency counts once on each shard its locks are on.
    pub async fn renew_batch(
        &self,
        locks: &[(&str, u64)],
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<Vec<RenewOutcome>, LockError> {
        if locks.is_empty() || locks.len() > self.limits.max_batch {
            return Err(invalid(format!(
                "locks must hold 1 to {} entries",
                self.limits.max_batch
            )));
        }
        let mut ids = Vec::with_capacity(locks.len());
        let mut seals: HashMap<&str, u64> = HashMap::default();
        for (i, (lock_id, token)) in locks.iter().enumerate() {
            let (id, seal) = self
                .open_uncounted(lock_id, *token, caller)
                .map_err(|e| match e {
                    LockError::PermissionDenied(Denied(m)) => {
                        Denied(format!("locks[{i}]: {m}")).into()
                    }
                    e => invalid(format!("locks[{i}]: {e}")),
                })?;
            *seals.entry(seal_label(seal)).or_default() += 1;
            ids.push(id);
        }
        for (key, n) in seals {
            crate::metrics::lock_ids_opened(key, n);
        }
        // One check and one keepalive per lease for each shard's locks. Each
        // known shard's latency is recorded as `by_shard` drops, when the
        // batch ends (also a shard that is down: its locks waited as long).
        let mut by_shard: HashMap<&str, ShardGroup> = HashMap::default();
        for (i, id) in ids.iter().enumerate() {
            let entry = by_shard.entry(id.shard.as_str()).or_insert_with(|| {
                let shard = self.shard_of(id).ok();
                let latency = shard
                    .as_ref()
                    .map(|s| s.metrics().latency(ShardOp::Renew, received));
                (shard, Vec::new(), latency)
            });
            entry.1.push(i);
        }
        let mut results = vec![RenewOutcome::Unavailable; ids.len()];
        let groups = join_all(by_shard.values().map(|(shard, at, _)| {
            let ids = &ids;
            async move {
                let Some(shard) = shard.as_ref().filter(|s| s.is_up()) else {
                    return (at, None);
                };
                let group: Vec<&LockId> = at.iter().map(|&i| &ids[i]).collect();
                (at, Some(self.renew_on(&**shard, &group, false).await))
            }
        }))
        .await;
        for (at, outcomes) in groups {
            let Some(outcomes) = outcomes else { continue };
            for (&i, outcome) in at.iter().zip(outcomes) {
                results[i] = match outcome {
                    Ok(o) => o,
                    Err(EtcdError::Unavailable { .. }) => RenewOutcome::Unavailable,
                    Err(e) => return Err(e.into()),
                };
            }
        }
        Ok(results)
    }

    /// Renews `ids`, all on `shard`: one check of their keys (the lock-key
    /// cache after one barrier, or reads when it cannot vouch), then one
    /// keepalive per lease that a lock of the batch was verified on. A
    /// lease is never kept alive on a lockId's word alone: a forged or
    /// stale lockId naming another holder's lease renews nothing
    /// (`docs/security.md`). A lock the check finds gone or taken is
    /// answered without a keepalive. `extend`: keep the leases alive now
    /// (within the coalescing window), not only once less than
    /// `keepalive_below_pct` of their TTL is left.
    pub(super) async fn renew_on<S: LockShard>(
        &self,
        shard: &S,
        ids: &[&LockId],
        extend: bool,
    ) -> Vec<Result<RenewOutcome, EtcdError>> {
        let sent = Instant::now();
        let hashes: Vec<_> = ids.iter().map(|id| id.name_hash).collect();
        let entries = shard.lock_entries(&hashes).await;
        let mine = |id: &LockId, entry: &Result<Option<Entry>, EtcdError>| matches!(entry, Ok(Some(e)) if *e == (id.revision, id.lease));
        // One keepalive per lease a lock of the request was verified on.
        let mut verified: HashMap<i64, u32> = HashMap::default();
        for (id, entry) in ids.iter().zip(&entries) {
            if mine(id, entry) {
                verified.entry(id.lease).or_insert(id.ttl_secs);
            }
        }
        let answers = join_all(verified.iter().map(|(&lease, &ttl)| {
            let window = if extend {
                self.keepalive.coalescing(ttl)
            } else {
                self.window(ttl)
            };
            shard.renew_session(lease, window, ttl)
        }))
        .await;
        let renewals: HashMap<i64, Result<Renewal, EtcdError>> =
            verified.keys().copied().zip(answers).collect();
        let now = Instant::now();
        if shard.note_renewal(now - sent, self.renewal_budget, now) {
            tracing::warn!(
                shard = %shard.name(),
                took_ms = (now - sent).as_millis() as u64,
                budget_ms = self.renewal_budget.as_millis() as u64,
                "renewals are slow: acquires of the shard's names are refused for a second"
            );
        }
        let mut outcomes = Vec::with_capacity(ids.len());
        for (id, entry) in ids.iter().zip(entries) {
            let outcome = match entry {
                Err(e) => Err(e),
                Ok(None) => Ok(RenewOutcome::Expired),
                Ok(Some(_)) if mine(id, &entry) => match &renewals[&id.lease] {
                    Ok(r) if r.alive() => {
                        Ok(RenewOutcome::Renewed(Expiry::vouched(r, sent, id.ttl_secs)))
                    }
                    Ok(_) => Ok(RenewOutcome::Expired),
                    Err(e) => Err(e.clone()),
                },
                Ok(Some(_)) => Ok(RenewOutcome::Stolen),
            };
            outcomes.push(outcome);
        }
        outcomes
    }
}

/// A renew-batch's locks on one shard: the shard (`None` if this router
/// does not know it), their places in the batch, and the batch's latency
/// on it.
type ShardGroup = (Option<Arc<Shard>>, Vec<usize>, Option<Latency>);
