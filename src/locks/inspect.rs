//! Inspect: who holds a name, with its token and expiry, looking on the
//! previous shard too while a migration moves the name.

use std::time::Instant;

use super::validate::check_text;
use super::*;
use crate::shard::keys::{name_hash, LockValue};
use crate::token::fencing;

impl Active {
    pub async fn inspect(&self, name: &str) -> Result<Inspection, LockError> {
        check_text("name", name, self.limits.max_name_bytes)?;
        let shard = self.router.shard_for(name);
        tracing::Span::current().record("shard", shard.name.as_str());
        let hash = name_hash(name);
        // During a migration a moved name may still be held where it was.
        let mut places = vec![shard.clone()];
        if let Some(m) = self.router.migration() {
            let previous = m.previous_shard(name);
            if previous.name != shard.name {
                places.push(previous.clone());
            }
        }
        for place in &places {
            check_identity(place)?;
            let state = place.read_name(&place.name_keys(&hash)).await?;
            if state.identity != place.verified_identity() {
                self.router.identity_changed(place);
                return Err(unavailable(
                    place,
                    "the cluster behind this shard's endpoints is not this shard",
                ));
            }
            if let Some(kv) = state.lock {
                let value: LockValue = serde_json::from_slice(kv.value())
                    .map_err(|e| LockError::Internal(format!("unreadable lock value: {e}")))?;
                let token = fencing::token(value.epoch, kv.create_revision())
                    .ok_or_else(|| LockError::Internal("token out of range".into()))?;
                // Held while the key exists, whatever etcd's whole-second
                // TTL says: a lease with 0.9 s left reads as 0 s, and the
                // name is still refused to others until etcd deletes the key.
                let expires = lease_end(place, &kv).await?;
                let expires = Expiry(expires.0.max(Instant::now()));
                return Ok(Inspection {
                    shard: place.name.clone(),
                    holder: Some((token, expires)),
                    client_id: Some(value.client),
                });
            }
        }
        Ok(Inspection {
            shard: shard.name.clone(),
            holder: None,
            client_id: None,
        })
    }
}
