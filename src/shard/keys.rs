//! The data layout on each shard, below the configured prefix `P`:
//!
//! - `P/shard` holds the shard's [`Identity`]: its name and the etcd
//!   cluster id, written once when the shard is first initialised. Every
//!   grant compares it byte for byte, so a router whose endpoints for "a"
//!   reach another cluster (a typo, a swapped pair) can never grant there.
//! - `P/ring` holds the [`RingMeta`] (epoch and ring fingerprint) that every
//!   acquire compares byte for byte.
//! - `P/epoch` holds the highest ring epoch any writer has reserved
//!   ([`Reservation`]): an epoch bump or a migration reserves its epoch on
//!   every shard before it records it anywhere, so a later bump always goes
//!   past every epoch that may have been used, even on a shard since wiped.
//! - `P/cutoff/<n, 20 digits>` are the grant cut-off's marks, empty
//!   values: every acquire txn compares that no mark above the one its
//!   router last saw exists, and a router whose grant txn went unanswered
//!   puts the next mark, so that the txn grants nothing if it lands later.
//! - `P/locks/<hex of the first 16 bytes of SHA-256(name)>` is a held lock,
//!   attached to its session lease, with a [`LockValue`] naming the holder.
//!   Hashing bounds key size and keeps lockIds short; a collision could only
//!   make two names exclude each other (safe), never grant one name twice.
//! - `P/held/<hash>` is created with the lock key, without a lease, and
//!   deleted only by a release: a held record without its lock key means the
//!   holder was *lost* (its lease ended), not released.
//! - `P/delay/<hash>` is the lock-delay of a lost holder: on a fresh lease of
//!   the lost lock's TTL, it keeps the name ungrantable until any validity
//!   the lost holder was told of has surely passed (see `docs/design.md`).
//! - `P/waiters/<hash>/<lease>` is a caller waiting for the name
//!   (`waitMs`), attached to a lease of its own; the queue is ordered by the
//!   keys' create revisions.

use etcd_client::{Compare, CompareOp, GetOptions, SortOrder, SortTarget, TxnOp};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::ShardSettings;

pub use crate::token::lock_id::NameHash;

/// The name hash a key's 32-hex-digit suffix spells (a lock key's, a held
/// record's), or `None` for any other suffix.
pub fn hash_of_hex(hex: &[u8]) -> Option<NameHash> {
    let mut hash = NameHash::default();
    hex::decode_to_slice(hex, &mut hash).ok()?;
    Some(hash)
}

pub fn name_hash(name: &str) -> NameHash {
    let digest = Sha256::digest(name.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&digest[..16]);
    out
}

/// Key names on one shard.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
        }
    }

    pub fn ring(&self) -> Vec<u8> {
        format!("{}/ring", self.prefix).into_bytes()
    }

    pub fn identity(&self) -> Vec<u8> {
        format!("{}/shard", self.prefix).into_bytes()
    }

    /// The grant cut-off's mark `n` (`P/cutoff/<n>`, zero-padded to 20
    /// digits so that marks sort as numbers): every acquire txn compares
    /// that no mark above the one its router last saw exists, and a router
    /// whose grant txn went unanswered puts the next one, so that the txn,
    /// if it lands later, grants nothing (`docs/design.md`, "An acquire
    /// that was not answered").
    pub fn cutoff_mark(&self, n: i64) -> Vec<u8> {
        format!("{}/cutoff/{n:020}", self.prefix).into_bytes()
    }

    /// Start and end (exclusive) of the range of cut-off marks.
    pub fn cutoff_marks(&self) -> (Vec<u8>, Vec<u8>) {
        self.range("cutoff")
    }

    /// A grant txn's compare of the grant cut-off `seen` it last saw: no
    /// mark above it exists (the range compares as 0 while it is empty),
    /// so a move of the cut-off after the txn was sent makes it grant
    /// nothing. A range with no key in it is answered from etcd's index,
    /// without the read of the backend a compare of an existing key costs.
    pub fn cutoff_compare(&self, seen: i64) -> Compare {
        let end = self.range_end("cutoff");
        Compare::create_revision(
            self.cutoff_mark(seen.saturating_add(1)),
            CompareOp::Equal,
            0,
        )
        .with_range(end)
    }

    /// The read of the shard's grant cut-off: its highest mark, which
    /// [`Keys::cutoff_of`] takes.
    pub fn cutoff_read(&self) -> TxnOp {
        let (start, end) = self.cutoff_marks();
        let highest = GetOptions::new()
            .with_range(end)
            .with_sort(SortTarget::Key, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        TxnOp::get(start, Some(highest))
    }

    /// The cut-off a [`Keys::cutoff_read`] found: the mark its key names,
    /// 0 if there was none.
    pub fn cutoff_of(&self, read: Option<Stored>) -> i64 {
        let (start, _) = self.cutoff_marks();
        let digits = |mark: Stored| {
            let n = mark.key().strip_prefix(start.as_slice())?;
            std::str::from_utf8(n).ok()?.parse().ok()
        };
        read.and_then(digits).unwrap_or(0)
    }

    pub fn epoch(&self) -> Vec<u8> {
        format!("{}/epoch", self.prefix).into_bytes()
    }

    /// The held record of a name: created with its lock key, deleted only
    /// by a release.
    pub fn held(&self, hash: &NameHash) -> Vec<u8> {
        self.name_key("held", hash, "")
    }

    /// The lock-delay of a name whose holder was lost.
    pub fn delay(&self, hash: &NameHash) -> Vec<u8> {
        self.name_key("delay", hash, "")
    }

    /// The name hash a held record's key ends in; the all-zero hash if
    /// its suffix is not one (the router writes none such, and no name's
    /// records sit at the zero hash, so the txns over them change nothing).
    pub fn hash_of_held(&self, key: &[u8]) -> NameHash {
        let (start, _) = self.held_range();
        hash_of_hex(&key[start.len().min(key.len())..]).unwrap_or_default()
    }

    /// Start and end (exclusive) of the range of held records.
    pub fn held_range(&self) -> (Vec<u8>, Vec<u8>) {
        self.range("held")
    }

    /// Start and end (exclusive) of the range of lock-delays.
    pub fn delay_range(&self) -> (Vec<u8>, Vec<u8>) {
        self.range("delay")
    }

    pub fn lock(&self, hash: &NameHash) -> Vec<u8> {
        self.name_key("locks", hash, "")
    }

    /// Prefix of the queue of waiters for a name (`P/waiters/<hash>/`).
    pub fn waiters(&self, hash: &NameHash) -> Vec<u8> {
        self.name_key("waiters", hash, "/")
    }

    /// One waiter's key, named by the lease its entry rides on (which
    /// carries one wait's entry at a time); ordered by its create revision.
    pub fn waiter(&self, hash: &NameHash, lease: i64) -> Vec<u8> {
        let mut key = self.waiters(hash);
        key.extend_from_slice(format!("{lease:016x}").as_bytes());
        key
    }

    /// The barrier key of the lock-key cache: just past every lock key, so
    /// outside counts of `P/locks/` but inside the cache's watch.
    pub fn barrier(&self) -> Vec<u8> {
        format!("{}/locks0", self.prefix).into_bytes()
    }

    /// The end (exclusive) of the lock-key cache's watch, which starts at
    /// `P/locks/` and takes in the barrier key.
    pub fn cache_range_end(&self) -> Vec<u8> {
        format!("{}/locks1", self.prefix).into_bytes()
    }

    /// Start and end (exclusive) of the range holding every lock key.
    pub fn locks_range(&self) -> (Vec<u8>, Vec<u8>) {
        self.range("locks")
    }

    /// `P/<kind>/<hex of hash><tail>`, built without the formatting
    /// machinery: every acquire and release builds several of these.
    fn name_key(&self, kind: &str, hash: &NameHash, tail: &str) -> Vec<u8> {
        let hex_len = 2 * hash.len();
        let mut key = Vec::with_capacity(self.prefix.len() + kind.len() + 2 + hex_len + tail.len());
        key.extend_from_slice(self.prefix.as_bytes());
        key.push(b'/');
        key.extend_from_slice(kind.as_bytes());
        key.push(b'/');
        let start = key.len();
        key.resize(start + hex_len, 0);
        hex::encode_to_slice(hash, &mut key[start..]).expect("sized for the hash");
        key.extend_from_slice(tail.as_bytes());
        key
    }

    fn range(&self, kind: &str) -> (Vec<u8>, Vec<u8>) {
        let start = format!("{}/{kind}/", self.prefix).into_bytes();
        (start, self.range_end(kind))
    }

    /// The end (exclusive) of [`Keys::range`] of `kind`.
    fn range_end(&self, kind: &str) -> Vec<u8> {
        format!("{}/{kind}0", self.prefix).into_bytes() // '0' follows '/'
    }
}

/// One key as the shard read it: the parts of etcd's `KeyValue` that
/// lockrouter reads (a lock key, a held record, a lock-delay, a waiter's
/// entry), so that nothing above the shard names etcd's types. Made only
/// here, from what etcd answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    pub(super) key: Vec<u8>,
    pub(super) value: Vec<u8>,
    /// The revision that created the key: a lock's grant (the fencing
    /// token's low bits), a waiter's place in its queue.
    pub(super) create_revision: i64,
    /// The revision of its last write: what a txn compares to replace or
    /// move exactly the record it read.
    pub(super) mod_revision: i64,
    /// The lease it rides on (0: none).
    pub(super) lease: i64,
}

impl Stored {
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    pub fn value(&self) -> &[u8] {
        &self.value
    }

    pub fn create_revision(&self) -> i64 {
        self.create_revision
    }

    pub fn mod_revision(&self) -> i64 {
        self.mod_revision
    }

    pub fn lease(&self) -> i64 {
        self.lease
    }
}

impl From<etcd_client::KeyValue> for Stored {
    fn from(kv: etcd_client::KeyValue) -> Self {
        let (create_revision, mod_revision, lease) =
            (kv.create_revision(), kv.mod_revision(), kv.lease());
        let (key, value) = kv.into_key_value();
        Self {
            key,
            value,
            create_revision,
            mod_revision,
            lease,
        }
    }
}

/// Value of a lock key: who holds it and in which ring epoch it was granted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LockValue {
    pub client: String,
    pub epoch: u64,
    pub name: String,
    /// The lock's TTL in whole seconds as the client asked for it (0 in
    /// locks granted before it was recorded).
    #[serde(default)]
    pub ttl: u32,
    /// When the router granted it, in ms since the Unix epoch, by its
    /// clock (0 in locks granted before it was recorded). For people:
    /// nothing is decided by it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub at: u64,
    /// What the acquirer attached to the lock (a small JSON object or
    /// string), shown by inspect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<serde_json::Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Value of a held record and of a lock-delay: which name, and the TTL of
/// the grant (the lock-delay a lost holder's name waits out).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeldValue {
    pub name: String,
    pub ttl: u32,
}

/// Value of `P/shard`: which shard of the deployment this etcd cluster is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    /// The shard's name in the routers' config.
    pub shard: String,
    /// The etcd cluster id (hex) when the identity was written; a different
    /// id today means the data was restored into, or copied to, another
    /// cluster (revisions may have gone back: bump the epoch).
    pub cluster_id: String,
}

impl Identity {
    pub fn new(shard: &str, cluster_id: u64) -> Self {
        Self {
            shard: shard.to_string(),
            cluster_id: format!("{cluster_id:016x}"),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("Identity serialises")
    }
}

/// Value of `P/epoch`: the highest epoch reserved on this shard, and by
/// which bump or migration (a random nonce), so that two writers can never
/// both own one epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reservation {
    pub epoch: u64,
    pub by: String,
}

impl Reservation {
    /// A reservation of `epoch` by a new writer (a random nonce names it).
    pub fn fresh(epoch: u64) -> Self {
        use std::hash::{BuildHasher, RandomState};
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let seed = (std::process::id(), n, std::time::SystemTime::now());
        Self {
            epoch,
            by: format!("{:016x}", RandomState::new().hash_one(seed)),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("Reservation serialises")
    }
}

/// Value of the ring key. Acquires compare the exact bytes read from the
/// shard, so any change to it (an epoch bump, a migration opening or
/// closing) stops grants made against the old value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RingMeta {
    /// Ring epoch: the high bits of every token granted under this ring.
    pub epoch: u64,
    /// Fingerprint of the ring that places names (see `ring.rs`).
    pub ring: String,
    /// While a migration is open: the ring names moved away from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<PreviousRing>,
}

/// The ring before a migration, complete enough for any replica (even one
/// started mid-migration) to place names on it and reach its shards.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PreviousRing {
    pub ring: String,
    pub vnodes: u32,
    pub shards: Vec<ShardSettings>,
}

impl RingMeta {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("RingMeta serialises")
    }
}

/// A ring meta as read from a shard, with its exact bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub meta: RingMeta,
    pub bytes: Vec<u8>,
}

impl Recorded {
    pub fn new(meta: RingMeta) -> Self {
        Self {
            bytes: meta.to_bytes(),
            meta,
        }
    }

    /// Parses a ring key's value; an unreadable one is kept (epoch 0) so it
    /// is reported, never overwritten.
    pub fn parse(bytes: &[u8]) -> Self {
        let meta = serde_json::from_slice(bytes).unwrap_or(RingMeta {
            epoch: 0,
            ring: format!("unreadable: {:?}", String::from_utf8_lossy(bytes)),
            previous: None,
        });
        Self {
            meta,
            bytes: bytes.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn key_suffixes_parse_back_to_their_hash() {
        let hash = super::name_hash("process_order:42");
        let hex = hex::encode(hash);
        assert_eq!(super::hash_of_hex(hex.as_bytes()), Some(hash));
        assert_eq!(super::hash_of_hex(b"short"), None);
        assert_eq!(super::hash_of_hex(&[b'z'; 32]), None);
    }

    use super::*;

    fn stored(key: &[u8]) -> Stored {
        let pb = etcd_client::proto::PbKeyValue {
            key: key.to_vec(),
            ..Default::default()
        };
        Stored::from(<&etcd_client::KeyValue>::from(&pb).clone())
    }

    /// A txn compares the range of marks above the one it saw, and a move
    /// deletes the range below its own: both need marks that sort as the
    /// numbers they name, and a read of the highest to name it back.
    #[test]
    fn cutoff_marks_sort_as_their_numbers_and_read_back() {
        let keys = Keys::new("/lockrouter");
        let (start, end) = keys.cutoff_marks();
        let marks: Vec<Vec<u8>> = [1, 9, 10, 99, 100, i64::MAX]
            .iter()
            .map(|&n| keys.cutoff_mark(n))
            .collect();
        assert!(marks.windows(2).all(|w| w[0] < w[1]), "{marks:?}");
        assert!(marks.iter().all(|m| start < *m && *m < end));
        assert_eq!(keys.cutoff_of(Some(stored(&keys.cutoff_mark(10)))), 10);
        assert_eq!(keys.cutoff_of(Some(stored(&marks[5]))), i64::MAX);
        // No mark read, or a key that is not one: no cut-off seen.
        assert_eq!(keys.cutoff_of(None), 0);
        assert_eq!(keys.cutoff_of(Some(stored(b"/lockrouter/cutoff/x"))), 0);
        assert_eq!(keys.cutoff_of(Some(stored(b"/other/cutoff/7"))), 0);
    }

    #[test]
    fn a_stored_key_keeps_what_etcd_answered() {
        let pb = etcd_client::proto::PbKeyValue {
            key: b"/lockrouter/locks/ab".to_vec(),
            value: b"{}".to_vec(),
            create_revision: 7,
            mod_revision: 9,
            version: 2,
            lease: 42,
        };
        let kv = <&etcd_client::KeyValue>::from(&pb).clone();
        let stored = Stored::from(kv);
        assert_eq!(stored.key(), b"/lockrouter/locks/ab");
        assert_eq!(stored.value(), b"{}");
        assert_eq!(
            (
                stored.create_revision(),
                stored.mod_revision(),
                stored.lease()
            ),
            (7, 9, 42)
        );
    }

    #[test]
    fn a_held_records_key_gives_its_names_hash_and_a_bad_one_the_zero_hash() {
        let keys = Keys::new("/lockrouter");
        let hash = name_hash("process_order:42");
        assert_eq!(keys.hash_of_held(&keys.held(&hash)), hash);
        let zero = NameHash::default();
        for bad in [
            &b"/lockrouter/held/zz"[..],
            b"/lockrouter/held/",
            b"/lockrouter/held/0123456789abcdef0123456789abcdeg",
            b"/x",
        ] {
            assert_eq!(keys.hash_of_held(bad), zero, "{bad:?}");
        }
    }

    /// The keys are on every shard's disk: building them differently must
    /// not change a byte.
    #[test]
    fn name_keys_keep_their_layout() {
        let keys = Keys::new("/lockrouter");
        let hash = name_hash("process_order:42");
        let h: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex::encode(hash), h);
        assert_eq!(
            keys.lock(&hash),
            format!("/lockrouter/locks/{h}").into_bytes()
        );
        assert_eq!(
            keys.held(&hash),
            format!("/lockrouter/held/{h}").into_bytes()
        );
        assert_eq!(
            keys.delay(&hash),
            format!("/lockrouter/delay/{h}").into_bytes()
        );
        assert_eq!(
            keys.waiters(&hash),
            format!("/lockrouter/waiters/{h}/").into_bytes()
        );
    }
}
