//! Inspect: who holds a name, with its token and expiry, looking on the
//! previous shard too while a migration moves the name.

use std::time::{Duration, Instant, UNIX_EPOCH};

use super::*;
use crate::shard::keys::{name_hash, NameHash, Stored};
use crate::shard::ops::LockShard;

impl Active {
    /// Where `name` may be held: its shard and, during a migration that
    /// moved it, its previous shard (a holder keeps it there until it lets
    /// go).
    pub(crate) fn places(&self, name: &LockName) -> Vec<Arc<Shard>> {
        let shard = self.router.shard_for(name.as_str());
        crate::task::name_shard(shard.name());
        let mut places = vec![shard.clone()];
        if let Some(m) = self.router.migration() {
            let previous = m.previous_shard(name.as_str());
            if previous.name() != shard.name() {
                places.push(previous.clone());
            }
        }
        places
    }

    /// Reads `k` on `place`, which must answer as the cluster this router
    /// verified for it.
    pub(crate) async fn read_verified(
        &self,
        place: &Shard,
        k: &crate::shard::NameKeys,
    ) -> Result<crate::shard::NameState, LockError> {
        check_identity(place)?;
        let state = place.read_name(k).await?;
        if state.identity != place.verified_identity() {
            self.router.identity_changed(place);
            return Err(unavailable(
                place,
                "the cluster behind this shard's endpoints is not this shard",
            ));
        }
        Ok(state)
    }

    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        let name = self.lock_name(name.to_string())?;
        let hash = name_hash(name.as_str());
        let places = self.places(&name);
        for place in &places {
            let state = self.read_verified(place, &place.name_keys(&hash)).await?;
            if let Some(kv) = state.lock {
                return self.inspect_on(&**place, &places[0], &hash, Some(kv)).await;
            }
        }
        self.inspect_on(&*places[0], &places[0], &hash, None).await
    }

    /// What `lock`, the name's lock key as read on `place` (`None`: held
    /// nowhere), shows of its holder, with the waiters queued on `own`
    /// (the name's own shard: the only one with a queue for it).
    pub(crate) async fn inspect_on<S: LockShard>(
        &self,
        place: &S,
        own: &S,
        hash: &NameHash,
        lock: Option<Stored>,
    ) -> Result<Inspection, LockError> {
        let queue = own.name_keys(hash);
        let Some(kv) = lock else {
            return Ok(Inspection {
                shard: own.name().to_string(),
                holder: None,
                client_id: None,
                acquired_at: None,
                metadata: None,
                waiters: own.queue_len(&queue).await?,
            });
        };
        let (value, token) = held_by(&kv)?;
        // Held while the key exists, whatever etcd's whole-second TTL says:
        // a lease with 0.9 s left reads as 0 s, and the name is still
        // refused to others until etcd deletes the key.
        let expires = lease_end(place, &kv).await?;
        let expires = Expiry(expires.0.max(Instant::now()));
        let at = Some(value.at).filter(|ms| *ms > 0);
        Ok(Inspection {
            shard: place.name().to_string(),
            holder: Some((token, expires)),
            client_id: Some(value.client),
            acquired_at: at.map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
            metadata: value.meta,
            waiters: own.queue_len(&queue).await?,
        })
    }
}
