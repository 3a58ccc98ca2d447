//! Force-release: an operator takes a name away from its holder (a stuck
//! worker). The exact lock key read (its create revision and lease) is
//! deleted with its held record, by the same txn a release uses, so a
//! grant made in between is never touched; the next grant of the name
//! creates a new key, so its token is larger; the former holder's renewals
//! answer 409 and its release does nothing.
//!
//! With a precondition (the fencing token the operator saw in `inspect`),
//! only that grant is taken: a holder whose token differs keeps the name.
//! The token's epoch is checked against the key read (etcd cannot compare
//! inside a value), and its create revision by etcd itself in the delete's
//! txn, so a grant made between the read and the delete is never touched.

use super::*;
use crate::shard::keys::{name_hash, Stored};
use crate::shard::ops::LockShard;
use crate::shard::NameKeys;
use crate::token::fencing;

impl Active {
    /// Deletes the lock that holds `name` now, if any (on its shard, or
    /// during a migration on the previous shard where it may still be
    /// held); with `only`, only if it is the grant with that token.
    pub async fn force_release(
        &self,
        name: &str,
        only: Option<u64>,
    ) -> Result<ForceOutcome, LockError> {
        let name = self.lock_name(name.to_string())?;
        if let Some(token) = only {
            let (epoch, revision) = fencing::split(token);
            if fencing::token(epoch, revision) != Some(token) {
                return Err(invalid(format!(
                    "fencingToken {token} is not a token this router issues"
                )));
            }
        }
        let hash = name_hash(name.as_str());
        for place in &self.places(&name) {
            let k = place.name_keys(&hash);
            let state = self.read_verified(place, &k).await?;
            if let Some(done) = self.force_on(&**place, &k, state.lock, only).await? {
                return Ok(done);
            }
        }
        Ok(ForceOutcome::Free)
    }

    /// Takes `lock`, the lock key of `k`'s name as read on `place`, from
    /// its holder; with `only`, only if it is the grant with that token.
    /// `None`: nothing held the name there (or its holder let go since).
    pub(crate) async fn force_on<S: LockShard>(
        &self,
        place: &S,
        k: &NameKeys,
        lock: Option<Stored>,
        only: Option<u64>,
    ) -> Result<Option<ForceOutcome>, LockError> {
        let Some(kv) = lock else { return Ok(None) };
        let (value, fencing_token) = held_by(&kv)?;
        if only.is_some_and(|token| token != fencing_token) {
            return Ok(Some(ForceOutcome::OtherGrant { fencing_token }));
        }
        // The txn compares the create revision (the token's, when one was
        // given: they are equal here) and the lease: only the grant read is
        // deleted. Not counted in lockrouter_hold_seconds: a holder's own
        // releases are; force-releases have a counter of their own.
        let released = place.release_txn(k, kv.create_revision(), kv.lease());
        if !released.await?.released() {
            // Released or expired between the read and the txn: that grant
            // holds it no more.
            return Ok(None);
        }
        Ok(Some(ForceOutcome::Released(Forced {
            shard: place.name().to_string(),
            fencing_token,
            client_id: value.client,
        })))
    }
}
