//! Release: deletes the lock key and its held record only if the key still
//! has the lockId's create revision and lease, so a stale lockId never
//! touches a later holder.

use super::*;

impl Active {
    /// After this the name is not held under `lock_id` (released now or
    /// already gone).
    pub async fn release(&self, lock_id: &str, token: u64) -> Result<(), LockError> {
        let id = decode(lock_id, token)?;
        let shard = self.shard_of(&id)?;
        check_identity(&shard)?;
        let k = shard.name_keys(&id.name_hash);
        shard.release_txn(&k, id.revision, id.lease).await?;
        Ok(())
    }
}
