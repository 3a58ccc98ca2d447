//! Extend: a held lock moved onto its client's session lease of another
//! TTL, in one txn that keeps the lock key (and so its create revision and
//! fencing token) and fails if the key changed since it was read
//! (`docs/design.md`, "Extend").

use std::time::Instant;

use super::*;
use crate::shard::{SessionLease, SessionUse};
use crate::token::lock_id::LockId;

impl Active {
    /// Moves the lock of `lock_id` onto its client's session lease of
    /// `ttl_ms` (rounded up to whole seconds, as at acquire). The same TTL
    /// is a renewal now, under the same lockId. Its latency counts as a
    /// renewal's on the lock's shard, from `received`.
    pub async fn extend(
        &self,
        lock_id: &str,
        token: u64,
        ttl_ms: u64,
        caller: Caller<'_>,
        received: Instant,
    ) -> Result<Extended, LockError> {
        let id = self.open(lock_id, token, caller)?;
        let ttl = self.ttl(ttl_ms)?;
        let shard = self.shard_of(&id)?;
        let _latency = shard.metrics().latency(ShardOp::Renew, received);
        check_up(&shard)?;
        let owner = owner_of(caller);
        let identity_changed = || self.router.identity_changed(&shard);
        let sealed = (lock_id, token);
        self.extend_on(&*shard, &id, sealed, ttl, owner, identity_changed)
            .await
    }

    /// Moves the lock `id` names on `shard` (its lockId and token as the
    /// caller sent them: `sealed`) onto `owner`'s client's session lease
    /// of `ttl`; `identity_changed` tells the router that the cluster
    /// behind the shard's endpoints is not the one verified.
    pub(crate) async fn extend_on<S: LockShard>(
        &self,
        shard: &S,
        id: &LockId,
        (lock_id, token): (&str, u64),
        ttl: SessionTtl,
        owner: Option<Owner>,
        identity_changed: impl Fn(),
    ) -> Result<Extended, LockError> {
        let ttl_secs = ttl.secs();
        if ttl_secs == id.ttl_secs {
            let outcome = self.renew_on(shard, &[id], true).await.pop();
            return Ok(match outcome.expect("one outcome per lock")? {
                RenewOutcome::Renewed(expires) => Extended::Moved(Grant {
                    lock_id: lock_id.to_string(),
                    fencing_token: token,
                    expires,
                }),
                refused => Extended::Refused(refused),
            });
        }
        let k = shard.name_keys(&id.name_hash);
        // Retried when the session lease of the new TTL turned out gone, the
        // lock's records changed between the read and the txn, or the txn
        // went unanswered.
        for _ in 0..3 {
            let identity = shard.verified_identity().ok_or_else(|| {
                unavailable(shard, "the shard's identity is not verified yet; retry")
            })?;
            let state = shard.read_name(&k).await?;
            if state.identity.as_deref() != Some(identity.as_slice()) {
                identity_changed();
                return Err(unavailable(
                    shard,
                    "the cluster behind this shard's endpoints is not this shard",
                ));
            }
            let Some(lock) = state.lock else {
                return Ok(Extended::Refused(RenewOutcome::Expired));
            };
            if (lock.create_revision(), lock.lease()) != (id.revision, id.lease) {
                return Ok(Extended::Refused(RenewOutcome::Stolen));
            }
            let mut value: LockValue =
                serde_json::from_slice(lock.value()).map_err(Corrupt::LockValue)?;
            value.ttl = ttl_secs;
            // Not reserved in the owner's `max_sessions` (the lock count does
            // not change; the cache counts the session once the lock is on
            // it): `docs/design.md`, "Extend".
            let tag = owner.as_ref().map(|o| o.tag);
            let session = shard
                .session(&value.client, ttl_secs, tag, SessionUse::Pinned, || {
                    Ok::<_, LockError>(())
                })
                .await?;
            // The lease is confirmed alive before the lock moves onto it, and
            // the expiry answered counts from this keepalive's send: the key
            // is on this lease from the txn on, and until then on the old
            // lease, which the read found still carrying it.
            let sent = Instant::now();
            let window = self.keepalive.coalescing(ttl_secs);
            let Some(renewal) = shard.keep_session(&value.client, &session, window).await? else {
                continue; // gone, and forgotten: the next try gets another
            };
            let was = (&lock, state.held.as_ref());
            let cutoff = shard.cutoff();
            let moved = shard.move_lock(&k, was, &value, session.id, (&identity, cutoff));
            match acquire::unless_cut_off(shard, cutoff, moved.await).await {
                Ok(Some(true)) => {
                    return self.extended(id, (session, ttl_secs), &value.client, &renewal, sent);
                }
                // Changed since the read: read again, which tells.
                Ok(Some(false)) => {}
                // Unanswered, and cut off: a move held on its way could
                // have landed later and taken the lock off the lease its
                // holder renews; now it cannot, and the read that settles
                // it says at once whether it did before (an error of a
                // later step would leave the caller unaware of it).
                Ok(None) => {
                    let settled = shard.read_name_settled(&k).await?;
                    let moved_to = |l: &Stored| (l.create_revision(), l.lease());
                    if settled.lock.as_ref().map(moved_to) == Some((id.revision, session.id)) {
                        return self.extended(
                            id,
                            (session, ttl_secs),
                            &value.client,
                            &renewal,
                            sent,
                        );
                    }
                }
                // Found gone right after it was got, alive by its last
                // confirmed renewal: ended early.
                Err(EtcdError::LeaseNotFound) => {
                    shard.session_gone(&value.client, &session, true).await
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(unavailable(
            shard,
            "the lock's records or its new session lease kept changing; retry",
        ))
    }

    /// The answer of a lock `id` moved onto `session` (of `ttl_secs`), whose
    /// `renewal` was sent at `sent`: the new lockId, the same token.
    fn extended(
        &self,
        id: &LockId,
        (session, ttl_secs): (SessionLease, u32),
        client: &str,
        renewal: &Renewal,
        sent: Instant,
    ) -> Result<Extended, LockError> {
        let lock = LockId {
            ttl_secs,
            lease: session.id,
            ..id.clone()
        };
        Ok(Extended::Moved(self.grant(lock, client, renewal, sent)?))
    }
}
