//! Release: deletes the lock key and its held record only if the key still
//! has the lockId's create revision and lease, so a stale lockId never
//! touches a later holder. How long the lock was held is learnt from the
//! deleted value (`lockrouter_hold_seconds`), without another read.

use super::*;
use crate::shard::ops::LockShard;
use crate::shard::ReleaseTxn;
use crate::token::lock_id::LockId;

impl Active {
    /// After this the name is not held under `lock_id` (released now or
    /// already gone).
    pub async fn release(
        &self,
        lock_id: &str,
        token: u64,
        caller: Caller<'_>,
    ) -> Result<(), LockError> {
        let id = self.open(lock_id, token, caller)?;
        let shard = self.shard_of(&id)?;
        check_identity(&shard)?;
        self.release_on(shard.as_ref(), &id).await
    }

    /// Releases the lock `id` names on `shard`, which it rides on.
    pub(crate) async fn release_on<S: LockShard>(
        &self,
        shard: &S,
        id: &LockId,
    ) -> Result<(), LockError> {
        let k = shard.name_keys(&id.name_hash);
        let done = shard.release_txn(&k, id.revision, id.lease).await?;
        if let ReleaseTxn::Released {
            granted_at: Some(at),
        } = done
        {
            // By two routers' clocks (the granting one's, this one's): a
            // skew shows as a longer or shorter hold, never a negative one.
            let held = SystemTime::now().duration_since(at).unwrap_or_default();
            shard.metrics().lock_held(held);
        }
        Ok(())
    }
}
