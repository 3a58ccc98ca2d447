//! Renew and renew-batch: a coalesced keepalive of the lock's lease and a
//! batched linearizable check that the key still has the lockId's create
//! revision and lease; a lock found gone is answered without waiting for
//! the keepalive.

use std::time::Instant;

use futures::future::{join_all, Either};

use super::*;
use crate::shard::conn::EtcdError;
use crate::shard::Shard;
use crate::token::lock_id::LockId;

impl Active {
    pub async fn renew(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: Option<u64>,
    ) -> Result<RenewOutcome, LockError> {
        let id = decode(lock_id, token)?;
        if let Some(ttl_ms) = ttl_ms {
            let secs = self.ttl_secs(ttl_ms)?;
            if secs != id.ttl_secs {
                return Err(invalid(format!(
                    "ttlMs {ttl_ms} does not match the lock's TTL of {} s: a lock's TTL is fixed when it is acquired",
                    id.ttl_secs
                )));
            }
        }
        // A shard no longer in any ring was drained: the lock is gone.
        let shard = self.shard_of(&id)?;
        check_up(&shard)?;
        Ok(self.renew_on(&shard, &id).await?)
    }

    /// Renews every lock in `locks`; malformed entries fail the whole call
    /// (a client only sends lockIds it was given), shard outages only theirs.
    pub async fn renew_batch(
        &self,
        locks: &[(String, u64)],
    ) -> Result<Vec<RenewOutcome>, LockError> {
        if locks.is_empty() || locks.len() > self.limits.max_batch {
            return Err(invalid(format!(
                "locks must hold 1 to {} entries",
                self.limits.max_batch
            )));
        }
        let mut ids = Vec::with_capacity(locks.len());
        for (i, (lock_id, token)) in locks.iter().enumerate() {
            let id = decode(lock_id, *token).map_err(|e| invalid(format!("locks[{i}]: {e}")))?;
            let shard = self.shard_of(&id).ok();
            ids.push((id, shard));
        }
        let results = join_all(ids.iter().map(|(id, shard)| async move {
            let Some(shard) = shard else {
                return Ok(RenewOutcome::Unavailable);
            };
            if !shard.conn.is_up() {
                return Ok(RenewOutcome::Unavailable);
            }
            match self.renew_on(shard, id).await {
                Err(EtcdError::Unavailable { .. }) => Ok(RenewOutcome::Unavailable),
                other => other,
            }
        }))
        .await;
        results
            .into_iter()
            .map(|r| r.map_err(LockError::from))
            .collect()
    }

    /// The keepalive and the check run in parallel; a lock the check finds
    /// gone is answered at once, without waiting for the keepalive.
    async fn renew_on(&self, shard: &Shard, id: &LockId) -> Result<RenewOutcome, EtcdError> {
        let key = shard.keys.lock(&id.name_hash);
        let sent = Instant::now();
        let keepalive = shard
            .keepalive
            .refresh(id.lease, self.window(id.ttl_secs), id.ttl_secs);
        let verify = shard.verifier.get(key);
        let (mut keepalive, verify) = (std::pin::pin!(keepalive), std::pin::pin!(verify));
        let (current, early) = match futures::future::select(verify, &mut keepalive).await {
            Either::Left((current, _)) => (current, None),
            Either::Right((renewal, verify)) => (verify.await, Some(renewal)),
        };
        match current? {
            None => Ok(RenewOutcome::Expired),
            Some(kv) if kv.create_revision() == id.revision && kv.lease() == id.lease => {
                let renewal = match early {
                    Some(renewal) => renewal?,
                    None => keepalive.await?,
                };
                if !renewal.alive() {
                    return Ok(RenewOutcome::Expired);
                }
                shard.sessions.touch(id.lease);
                Ok(RenewOutcome::Renewed(Expiry::vouched(&renewal, sent)))
            }
            Some(_) => Ok(RenewOutcome::Stolen),
        }
    }
}
