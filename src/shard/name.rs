//! One lock name on a shard: its keys, what a grant compares, the txns
//! of a grant and a release built as values, and how their answers read
//! (`docs/design.md`, section 3). Nothing here calls etcd: the shard's
//! calls (`txn.rs`) and its group commit (`commit.rs`) send these.

use std::time::{Duration, SystemTime};

use etcd_client::{
    Compare, CompareOp, DeleteOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};

use super::conn::EtcdError;
use super::keepalive::Renewal;
use super::keys::{HeldValue, Keys, LockValue, NameHash, Recorded, Stored};

/// What a grant compares: the ring and the identity the router verified,
/// and the grant cut-off it last saw.
#[derive(Debug, Clone)]
pub struct Grantable {
    pub ring: Recorded,
    pub identity: Vec<u8>,
    /// The grant cut-off: the highest mark `P/cutoff/<n>` seen (0 while
    /// none was).
    pub cutoff: i64,
}

/// The keys of one name on one shard.
#[derive(Debug, Clone)]
pub struct NameKeys {
    pub hash: NameHash,
    pub lock: Vec<u8>,
    pub held: Vec<u8>,
    pub delay: Vec<u8>,
    /// Prefix of the name's queue of waiters.
    pub waiters: Vec<u8>,
}

impl NameKeys {
    /// The keys of the name hashed to `hash` under `keys`' prefix.
    pub fn new(keys: &Keys, hash: &NameHash) -> Self {
        Self {
            hash: *hash,
            lock: keys.lock(hash),
            held: keys.held(hash),
            delay: keys.delay(hash),
            waiters: keys.waiters(hash),
        }
    }
}

/// Outcome of a grant txn (plain or at the head of the queue).
#[derive(Debug)]
pub enum AcquireTxn {
    /// The key was created at this revision (the token's low bits).
    Granted { revision: i64 },
    /// Someone (maybe the caller itself) holds the name.
    Held(Stored),
    /// The name waits out a lost holder's lock-delay (this key's lease).
    Delayed(Stored),
    /// The holder was lost (its lease ended) and no lock-delay was set yet:
    /// this is its held record.
    Lost(Stored),
    /// Nobody holds it, but callers are queued for it (no barging).
    Queued,
    /// A waiter's own entry is gone (its lease ended).
    Gone,
    /// A waiter must wait for this entry (the one just ahead of it) to
    /// go, known by its key and create revision; the name's holder, if
    /// any, is given too.
    Behind(Stored, Option<Stored>),
    /// The shard's ring is not the one the router compared against.
    RingChanged(Option<Recorded>),
    /// The shard's identity is not the one the router verified.
    IdentityChanged,
    /// The grant cut-off moved past the one compared (to this mark): a
    /// txn sent before the move grants nothing; try again.
    CutoffMoved(i64),
}

/// What a grant on a client's session lease came to.
#[derive(Debug)]
pub enum SessionGrant {
    /// The session lease is gone, and forgotten (the holder's next acquire
    /// gets a new one). A lock key the txn may have created went with it.
    SessionGone,
    /// The grant txn's answer, and the renewal of the session sent with it.
    Answered(AcquireTxn, Result<Renewal, EtcdError>),
}

/// What a lock name looks like on a shard (one read-only txn).
#[derive(Debug, Default)]
pub struct NameState {
    pub lock: Option<Stored>,
    pub held: Option<Stored>,
    pub delay: Option<Stored>,
    pub ring: Option<Recorded>,
    pub identity: Option<Vec<u8>>,
}

/// The grant txn of one acquire on its own (`Shard::acquire_txn`).
pub fn acquire_txn(
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
    when.push(keys.cutoff_compare(g.cutoff));
    let mut reads = name_reads(keys, k);
    reads.push(keys.cutoff_read());
    Txn::new()
        .when(when)
        .and_then(grant_ops(k, value, lease))
        .or_else(reads)
}

/// Why an acquire txn did not grant, from the name's `state` and the
/// shard's `cutoff` its `Else` read: what the name's state says, or, when
/// it says nothing, a mark above the cut-off the txn compared.
pub fn refusal_or_cutoff(state: NameState, cutoff: i64, g: &Grantable) -> AcquireTxn {
    classify_refusal(state, g).unwrap_or(if cutoff > g.cutoff {
        AcquireTxn::CutoffMoved(cutoff)
    } else {
        AcquireTxn::Queued
    })
}

/// The release txn of one lock (`Shard::release_txn`). The lock key's
/// delete returns the value it deleted (`prev_kv`), which says when the
/// lock was granted: the release's answer, not another read.
pub fn release_txn(k: &NameKeys, revision: i64, lease: i64) -> Txn {
    Txn::new()
        .when([
            Compare::create_revision(k.lock.clone(), CompareOp::Equal, revision),
            Compare::lease(k.lock.clone(), CompareOp::Equal, lease),
        ])
        .and_then([
            TxnOp::delete(k.lock.clone(), Some(DeleteOptions::new().with_prev_key())),
            TxnOp::delete(k.held.clone(), None),
        ])
}

/// Outcome of a release txn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseTxn {
    /// The lock key was deleted. `granted_at`: when the lock was granted,
    /// by the granting router's clock, as the deleted value recorded it
    /// (`None` for locks granted before it was recorded).
    Released { granted_at: Option<SystemTime> },
    /// The key was gone already, or is another grant's: nothing deleted.
    NotHeld,
}

impl ReleaseTxn {
    pub fn released(&self) -> bool {
        matches!(self, ReleaseTxn::Released { .. })
    }
}

/// How the answer to [`release_txn`] (alone, or nested in a batch) reads.
pub fn release_outcome(resp: &TxnResponse) -> ReleaseTxn {
    if !resp.succeeded() {
        return ReleaseTxn::NotHeld;
    }
    // The lock key's delete comes first; the held record's asks no value.
    let at = match resp.op_responses().first() {
        Some(TxnOpResponse::Delete(d)) => d
            .prev_kvs()
            .first()
            .and_then(|kv| serde_json::from_slice::<LockValue>(kv.value()).ok())
            .map_or(0, |v| v.at),
        _ => 0,
    };
    ReleaseTxn::Released {
        granted_at: (at > 0).then(|| SystemTime::UNIX_EPOCH + Duration::from_millis(at)),
    }
}

/// The compares every grant makes on the name itself (the queue's are
/// added by the caller).
pub fn name_compares(k: &NameKeys, replace_held: Option<i64>) -> Vec<Compare> {
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
pub fn grant_compares(
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
pub fn shard_compares(keys: &Keys, g: &Grantable) -> [Compare; 2] {
    [
        Compare::value(keys.ring(), CompareOp::Equal, g.ring.bytes.clone()),
        Compare::value(keys.identity(), CompareOp::Equal, g.identity.clone()),
    ]
}

/// Reads of the name's own keys, in the order [`name_state`] takes them.
pub fn own_reads(k: &NameKeys) -> Vec<TxnOp> {
    vec![
        TxnOp::get(k.lock.clone(), None),
        TxnOp::get(k.held.clone(), None),
        TxnOp::get(k.delay.clone(), None),
    ]
}

/// Reads of everything that decides whether a name is grantable, in the
/// order [`name_state`] takes them.
pub fn name_reads(keys: &Keys, k: &NameKeys) -> Vec<TxnOp> {
    let mut reads = own_reads(k);
    reads.push(TxnOp::get(keys.ring(), None));
    reads.push(TxnOp::get(keys.identity(), None));
    reads
}

/// The ops of a grant: the lock key on the session lease, and its held
/// record (no lease) that only a release deletes.
pub fn grant_ops(k: &NameKeys, value: &LockValue, lease: i64) -> Vec<TxnOp> {
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
pub fn classify_refusal(state: NameState, g: &Grantable) -> Option<AcquireTxn> {
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

pub fn revision(resp: &TxnResponse) -> i64 {
    resp.header().map(|h| h.revision()).unwrap_or(0)
}

/// The first key of each get in a txn's answers, in order.
pub fn gets(resp: TxnResponse) -> impl Iterator<Item = Option<Stored>> {
    resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next().map(Stored::from),
        _ => None,
    })
}

pub fn read_name(resp: TxnResponse) -> NameState {
    name_state(&mut gets(resp))
}

/// Takes the answers of [`name_reads`] off `gets`.
pub fn name_state(gets: &mut impl Iterator<Item = Option<Stored>>) -> NameState {
    let mut next = || gets.next().flatten();
    NameState {
        lock: next(),
        held: next(),
        delay: next(),
        ring: next().map(|kv| Recorded::parse(kv.value())),
        identity: next().map(|kv| kv.value().to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::keys::RingMeta;

    fn ring(fingerprint: &str) -> Recorded {
        Recorded::new(RingMeta {
            epoch: 1,
            ring: fingerprint.into(),
            previous: None,
        })
    }

    fn kv(key: &str) -> Stored {
        Stored {
            key: key.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    fn grantable() -> Grantable {
        Grantable {
            ring: ring("r1"),
            identity: b"id".to_vec(),
            cutoff: 0,
        }
    }

    fn state(lock: bool, held: bool, delay: bool) -> NameState {
        NameState {
            lock: lock.then(|| kv("K")),
            held: held.then(|| kv("H")),
            delay: delay.then(|| kv("D")),
            ring: Some(ring("r1")),
            identity: Some(b"id".to_vec()),
        }
    }

    #[test]
    fn a_refusal_names_the_shard_first_then_the_name() {
        let g = grantable();
        // Identity before ring before the name's own keys: an answer read
        // from another cluster or under another ring says nothing about the
        // name.
        let mut other_cluster = state(true, true, true);
        other_cluster.identity = Some(b"other".to_vec());
        other_cluster.ring = Some(ring("r2"));
        assert!(matches!(
            classify_refusal(other_cluster, &g),
            Some(AcquireTxn::IdentityChanged)
        ));
        let mut other_ring = state(true, true, true);
        other_ring.ring = Some(ring("r2"));
        assert!(matches!(
            classify_refusal(other_ring, &g),
            Some(AcquireTxn::RingChanged(Some(_)))
        ));
        let mut no_ring = state(false, false, false);
        no_ring.ring = None;
        assert!(matches!(
            classify_refusal(no_ring, &g),
            Some(AcquireTxn::RingChanged(None))
        ));
        // Then a holder before a lock-delay before a lost holder's record.
        assert!(matches!(
            classify_refusal(state(true, true, true), &g),
            Some(AcquireTxn::Held(_))
        ));
        assert!(matches!(
            classify_refusal(state(false, true, true), &g),
            Some(AcquireTxn::Delayed(_))
        ));
        assert!(matches!(
            classify_refusal(state(false, true, false), &g),
            Some(AcquireTxn::Lost(_))
        ));
        // Free of all three: only a queue (or a change meanwhile) refused it.
        assert!(classify_refusal(state(false, false, false), &g).is_none());
    }
}
