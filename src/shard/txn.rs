//! The transactions on one lock name: the grant (plain and at the head of
//! a waiting queue), the release, the read of everything that decides
//! whether a name is grantable, and the lost-holder txns behind the
//! lock-delay (see `docs/design.md`, sections 3, 7 and 13).

use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};

use super::conn::EtcdError;
use super::keys::{HeldValue, Keys, LockValue, Recorded};
use super::{AcquireTxn, Grantable, NameKeys, NameState, QueueHead, Shard};
use crate::config::LockDelay;

impl Shard {
    /// Grants the name to `lease` if nobody holds it, no lock-delay or lost
    /// holder is pending, nobody is queued, and the shard still records
    /// `g`'s ring and identity; otherwise reads why not. `replace_held`:
    /// the mod revision of a lost holder's held record to overwrite (only
    /// when lock-delay is off). Goes to etcd in whatever group commit it
    /// joins (see [`commit`](super::commit)).
    pub async fn acquire_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        self.committer
            .acquire(k, value, lease, g, replace_held)
            .await
    }

    /// Grants the name to the waiter `mine` if it is first in the queue and
    /// the name is grantable (as [`acquire_txn`](Self::acquire_txn)),
    /// deleting its entry; otherwise says what it waits for.
    pub async fn head_grant_txn(
        &self,
        k: &NameKeys,
        value: &LockValue,
        lease: i64,
        g: &Grantable,
        mine: QueueHead<'_>,
        replace_held: Option<i64>,
    ) -> Result<AcquireTxn, EtcdError> {
        let mut when = grant_compares(&self.keys, k, g, replace_held);
        when.push(Compare::create_revision(
            mine.key,
            CompareOp::Equal,
            mine.revision,
        ));
        // Every queued key is as young as ours or younger: we are first.
        when.push(
            Compare::create_revision(k.waiters.clone(), CompareOp::Greater, mine.revision - 1)
                .with_prefix(),
        );
        let mut then = grant_ops(k, value, lease);
        then.push(TxnOp::delete(mine.key, None));
        let predecessor = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(mine.revision - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1);
        let mut reads = name_reads(&self.keys, k);
        reads.push(TxnOp::get(mine.key, None));
        reads.push(TxnOp::get(k.waiters.clone(), Some(predecessor)));
        let txn = Txn::new().when(when).and_then(then).or_else(reads);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(AcquireTxn::Granted {
                revision: revision(&resp),
            });
        }
        let mut gets = gets(resp);
        let state = name_state(&mut gets);
        let (me, before) = (gets.next().flatten(), gets.next().flatten());
        let holder = state.lock.clone();
        Ok(match (classify_refusal(state, g), before) {
            (Some(r @ (AcquireTxn::RingChanged(_) | AcquireTxn::IdentityChanged)), _) => r,
            _ if me.is_none() => AcquireTxn::Gone,
            (_, Some(ahead)) => AcquireTxn::Behind(ahead.key().to_vec(), holder),
            (Some(other), None) => other,
            // Free and first, yet the txn failed: something changed; look again.
            (None, None) => AcquireTxn::Queued,
        })
    }

    /// One linearizable read of a name's keys and the shard's ring and
    /// identity (the handoff check of a migration, and inspect).
    pub async fn read_name(&self, k: &NameKeys) -> Result<NameState, EtcdError> {
        let resp = self
            .txn(Txn::new().and_then(name_reads(&self.keys, k)))
            .await?;
        Ok(read_name(resp))
    }

    /// Turns a lost holder's held record into a lock-delay on `delay_lease`
    /// if the name is still not held and the record unchanged. Returns
    /// whether it did.
    pub async fn lost_to_delay(
        &self,
        k: &NameKeys,
        held: &KeyValue,
        delay_lease: i64,
        identity: &[u8],
    ) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
                Compare::value(self.keys.identity(), CompareOp::Equal, identity.to_vec()),
            ])
            .and_then([
                TxnOp::delete(k.held.clone(), None),
                TxnOp::put(
                    k.delay.clone(),
                    held.value().to_vec(),
                    Some(PutOptions::new().with_lease(delay_lease)),
                ),
            ]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Forgets a lost holder's held record (lock-delay off) if the name is
    /// still not held and the record unchanged.
    pub async fn forget_lost(&self, k: &NameKeys, held: &KeyValue) -> Result<bool, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(k.held.clone(), CompareOp::Equal, held.mod_revision()),
            ])
            .and_then([TxnOp::delete(k.held.clone(), None)]);
        Ok(self.txn(txn).await?.succeeded())
    }

    /// Deletes the lock key (and its held record) only if the key still has
    /// this create revision and lease, in whatever group commit it joins.
    /// Returns whether it deleted.
    pub async fn release_txn(
        &self,
        k: &NameKeys,
        revision: i64,
        lease: i64,
    ) -> Result<bool, EtcdError> {
        self.committer.release(k, revision, lease).await
    }

    /// Sets the lock-delay of a lost holder's name: grants a lease of `ttl`
    /// seconds (plus one, for rounding and clock rates) and moves the held
    /// record onto it. Returns when the delay ends at the earliest, and
    /// whether this call set it.
    pub async fn set_lock_delay(
        &self,
        k: &NameKeys,
        held: &KeyValue,
        identity: &[u8],
    ) -> Result<(Instant, bool), EtcdError> {
        let ttl = serde_json::from_slice::<HeldValue>(held.value())
            .map(|h| h.ttl)
            .unwrap_or(0);
        let sent = Instant::now();
        // Granted after the key was seen gone, so it ends no earlier than one
        // delay after the lost holder's key went.
        let (lease, granted) = self.grant(ttl.max(1) + 1).await?;
        let until = sent + Duration::from_secs(granted.max(0) as u64);
        let set = self.lost_to_delay(k, held, lease, identity).await?;
        if set {
            crate::metrics::lock_delay_set(&self.name);
            tracing::info!(shard = %self.name, ttl, "a holder was lost without releasing: lock-delay set");
        } else {
            let _ = self.revoke(lease).await;
        }
        Ok((until, set))
    }

    /// Deals with every held record whose lock key is gone (holders lost
    /// without releasing, whose names nobody asked for since): sets their
    /// lock-delays, or with lock-delay off forgets them, so that records do
    /// not pile up and a migration's moved names do not wait for them.
    pub async fn sweep_lost(&self, lock_delay: LockDelay) {
        let Some(identity) = self.verified_identity() else {
            return;
        };
        let Ok(orphans) = self.orphaned_held().await else {
            return;
        };
        for orphan in orphans {
            // The sweep read keys only: read the record itself (its TTL, and
            // the mod revision the conversion compares).
            let Ok(Some(held)) = self.get(orphan.key()).await else {
                continue;
            };
            let k = self.keys_of_held(&held);
            let done = match lock_delay {
                LockDelay::Ttl => self.set_lock_delay(&k, &held, &identity).await.map(|_| ()),
                LockDelay::Off => self.forget_lost(&k, &held).await.map(|_| ()),
            };
            if done.is_err() {
                return; // the shard is struggling; next round
            }
        }
    }
}

/// The grant txn of one acquire on its own (see [`Shard::acquire_txn`]).
pub(super) fn acquire_txn(
    keys: &Keys,
    k: &NameKeys,
    value: &LockValue,
    lease: i64,
    g: &Grantable,
    replace_held: Option<i64>,
) -> Txn {
    let mut when = grant_compares(keys, k, g, replace_held);
    // No queued waiter: an empty range compares as revision 0.
    when.push(Compare::create_revision(k.waiters.clone(), CompareOp::Equal, 0).with_prefix());
    Txn::new()
        .when(when)
        .and_then(grant_ops(k, value, lease))
        .or_else(name_reads(keys, k))
}

/// The release txn of one lock (see [`Shard::release_txn`]).
pub(super) fn release_txn(k: &NameKeys, revision: i64, lease: i64) -> Txn {
    Txn::new()
        .when([
            Compare::create_revision(k.lock.clone(), CompareOp::Equal, revision),
            Compare::lease(k.lock.clone(), CompareOp::Equal, lease),
        ])
        .and_then([
            TxnOp::delete(k.lock.clone(), None),
            TxnOp::delete(k.held.clone(), None),
        ])
}

/// The compares every grant makes on the name itself (the queue's are
/// added by the caller).
pub(super) fn name_compares(k: &NameKeys, replace_held: Option<i64>) -> Vec<Compare> {
    let held = match replace_held {
        None => Compare::create_revision(k.held.clone(), CompareOp::Equal, 0),
        Some(rev) => Compare::mod_revision(k.held.clone(), CompareOp::Equal, rev),
    };
    vec![
        Compare::create_revision(k.lock.clone(), CompareOp::Equal, 0),
        held,
        Compare::create_revision(k.delay.clone(), CompareOp::Equal, 0),
    ]
}

/// The compares every grant makes: the name's, and the shard's ring and
/// identity as `g` has them.
fn grant_compares(
    keys: &Keys,
    k: &NameKeys,
    g: &Grantable,
    replace_held: Option<i64>,
) -> Vec<Compare> {
    let mut when = name_compares(k, replace_held);
    when.extend(shard_compares(keys, g));
    when
}

/// The compares of the shard-level records a grant depends on.
pub(super) fn shard_compares(keys: &Keys, g: &Grantable) -> [Compare; 2] {
    [
        Compare::value(keys.ring(), CompareOp::Equal, g.ring.bytes.clone()),
        Compare::value(keys.identity(), CompareOp::Equal, g.identity.clone()),
    ]
}

/// Reads of the name's own keys, in the order [`name_state`] takes them.
pub(super) fn own_reads(k: &NameKeys) -> Vec<TxnOp> {
    vec![
        TxnOp::get(k.lock.clone(), None),
        TxnOp::get(k.held.clone(), None),
        TxnOp::get(k.delay.clone(), None),
    ]
}

/// Reads of everything that decides whether a name is grantable, in the
/// order [`name_state`] takes them.
fn name_reads(keys: &Keys, k: &NameKeys) -> Vec<TxnOp> {
    let mut reads = own_reads(k);
    reads.push(TxnOp::get(keys.ring(), None));
    reads.push(TxnOp::get(keys.identity(), None));
    reads
}

/// The ops of a grant: the lock key on the session lease, and its held
/// record (no lease) that only a release deletes.
pub(super) fn grant_ops(k: &NameKeys, value: &LockValue, lease: i64) -> Vec<TxnOp> {
    let held = HeldValue {
        name: value.name.clone(),
        ttl: value.ttl,
    };
    vec![
        TxnOp::put(
            k.lock.clone(),
            serde_json::to_vec(value).expect("LockValue serialises"),
            Some(PutOptions::new().with_lease(lease)),
        ),
        TxnOp::put(
            k.held.clone(),
            serde_json::to_vec(&held).expect("HeldValue serialises"),
            None,
        ),
    ]
}

/// Why a grant txn did not grant, from what its `Else` read; `None` when
/// the name is free of holders, delays and lost holders (so queued, or
/// changed meanwhile).
pub(super) fn classify_refusal(state: NameState, g: &Grantable) -> Option<AcquireTxn> {
    if state.identity.as_deref() != Some(g.identity.as_slice()) {
        return Some(AcquireTxn::IdentityChanged);
    }
    if state.ring.as_ref() != Some(&g.ring) {
        return Some(AcquireTxn::RingChanged(state.ring));
    }
    if let Some(kv) = state.lock {
        return Some(AcquireTxn::Held(kv));
    }
    if let Some(kv) = state.delay {
        return Some(AcquireTxn::Delayed(kv));
    }
    state.held.map(AcquireTxn::Lost)
}

pub(super) fn revision(resp: &TxnResponse) -> i64 {
    resp.header().map(|h| h.revision()).unwrap_or(0)
}

/// The first key of each get in a txn's answers, in order.
pub(super) fn gets(resp: TxnResponse) -> impl Iterator<Item = Option<KeyValue>> {
    resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
        _ => None,
    })
}

pub(super) fn read_name(resp: TxnResponse) -> NameState {
    name_state(&mut gets(resp))
}

/// Takes the answers of [`name_reads`] off `gets`.
pub(super) fn name_state(gets: &mut impl Iterator<Item = Option<KeyValue>>) -> NameState {
    let mut next = || gets.next().flatten();
    NameState {
        lock: next(),
        held: next(),
        delay: next(),
        ring: next().map(|kv| Recorded::parse(kv.value())),
        identity: next().map(|kv| kv.value().to_vec()),
    }
}
