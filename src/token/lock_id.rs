//! lockIds: self-describing, so any router replica can renew or release a
//! lock with no local state.
//!
//! Two layouts, then base64url without padding (integers big-endian):
//! - **sealed** (version 2, when `auth.lock_id_keys` is set):
//!   `2 | epoch u16 | ttl_secs u32 | lease i64 | revision i64 | name hash [16] |
//!   shard len u8 | shard | owner len u8 | owner | key len u8 | key id | mac [16]`,
//!   where the mac is the first 16 bytes of HMAC-SHA-256, under the key
//!   named by `key id`, of everything before it. Without the key nobody can
//!   make or alter one: an edited lockId (another epoch, lease or owner) is
//!   refused before anything is read or written.
//! - **checksummed** (version 1, without keys):
//!   `1 | epoch u16 | ttl_secs u32 | lease i64 | revision i64 | name hash [16] |
//!   shard len u8 | shard | checksum [4]` (the first 4 bytes of SHA-256 of
//!   everything before it), which only catches corruption and casual edits.
//!
//! Either way, safety rests on the etcd txns, which act only when the key
//! still has this create revision and this lease; the seal adds that a
//! lockId is one this deployment issued, to this owner (the principal that
//! acquired it, see `http::auth`).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use compact_str::CompactString;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::token::fencing;

/// The first 16 bytes of SHA-256 of a lock name (see the key layout).
pub type NameHash = [u8; 16];

const CHECKSUMMED: u8 = 1;
const SEALED: u8 = 2;
/// version, epoch, ttl, lease, revision, name hash, shard length.
const FIXED_LEN: usize = 1 + 2 + 4 + 8 + 8 + 16 + 1;
const CHECKSUM_LEN: usize = 4;
const MAC_LEN: usize = 16;
/// Longest lockId accepted (the API's bound).
pub const MAX_LEN: usize = 512;

/// Everything needed to find and act on one grant.
///
/// The shard and owner are short strings kept inline (no allocation for up
/// to 24 bytes): a renew-batch opens up to a thousand lockIds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockId {
    pub shard: CompactString,
    /// Ring epoch the grant was made in (the token's high bits).
    pub epoch: u16,
    /// TTL of the session lease the lock rides on, in whole seconds.
    pub ttl_secs: u32,
    pub lease: i64,
    /// Create revision of the lock key (the token's low bits).
    pub revision: i64,
    pub name_hash: NameHash,
    /// The principal that acquired the lock; empty without principals.
    /// Only sealed lockIds carry it.
    pub owner: CompactString,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("lockId is malformed or was altered")]
pub struct BadLockId;

impl LockId {
    pub fn token(&self) -> Option<u64> {
        fencing::token(self.epoch.into(), self.revision)
    }

    /// The checksummed (version 1) form; the owner is not part of it.
    pub fn encode(&self) -> String {
        let mut b = self.fixed(CHECKSUMMED);
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum[..CHECKSUM_LEN]);
        URL_SAFE_NO_PAD.encode(b)
    }

    /// Decodes a checksummed (version 1) lockId.
    pub fn decode(s: &str) -> Result<Self, BadLockId> {
        Self::decode_raw(raw(s, &mut [0; MAX_RAW])?)
    }

    /// Decodes the bytes of a checksummed (version 1) lockId.
    fn decode_raw(b: &[u8]) -> Result<Self, BadLockId> {
        if b.first() != Some(&CHECKSUMMED) || b.len() < FIXED_LEN + 1 + CHECKSUM_LEN {
            return Err(BadLockId);
        }
        let (body, sum) = b.split_at(b.len() - CHECKSUM_LEN);
        if Sha256::digest(body)[..CHECKSUM_LEN] != *sum {
            return Err(BadLockId);
        }
        let (id, rest) = parse_fixed(body)?;
        if !rest.is_empty() {
            return Err(BadLockId);
        }
        Ok(id)
    }

    /// The fields both layouts share, behind `version`.
    fn fixed(&self, version: u8) -> Vec<u8> {
        let mut b = Vec::with_capacity(FIXED_LEN + self.shard.len() + 64);
        b.push(version);
        b.extend_from_slice(&self.epoch.to_be_bytes());
        b.extend_from_slice(&self.ttl_secs.to_be_bytes());
        b.extend_from_slice(&self.lease.to_be_bytes());
        b.extend_from_slice(&self.revision.to_be_bytes());
        b.extend_from_slice(&self.name_hash);
        push_short(&mut b, &self.shard);
        b
    }
}

/// Longest decoded lockId: what [`MAX_LEN`] characters of base64 hold.
const MAX_RAW: usize = MAX_LEN / 4 * 3;

/// A buffer for a lockId's bytes, decoded on the stack: a renew-batch
/// opens up to a thousand of them, and none needs the heap.
type RawBuf = [u8; MAX_RAW];

/// Decodes `s` into `buf` (the caller's, so the bytes are not copied out
/// again) and returns them.
fn raw<'b>(s: &str, buf: &'b mut RawBuf) -> Result<&'b [u8], BadLockId> {
    if s.len() > MAX_LEN {
        return Err(BadLockId);
    }
    let len = URL_SAFE_NO_PAD
        .decode_slice(s, buf)
        .map_err(|_| BadLockId)?;
    Ok(&buf[..len])
}

/// A length byte, then the bytes (callers bound the length below 256).
fn push_short(b: &mut Vec<u8>, s: &str) {
    b.push(s.len() as u8);
    b.extend_from_slice(s.as_bytes());
}

/// A length byte and that many bytes of UTF-8 off the front of `b`.
fn take_short(b: &[u8]) -> Result<(&str, &[u8]), BadLockId> {
    let (&len, rest) = b.split_first().ok_or(BadLockId)?;
    if rest.len() < len as usize {
        return Err(BadLockId);
    }
    let (s, rest) = rest.split_at(len as usize);
    Ok((std::str::from_utf8(s).map_err(|_| BadLockId)?, rest))
}

/// The shared fields (owner left empty) and what follows them.
fn parse_fixed(b: &[u8]) -> Result<(LockId, &[u8]), BadLockId> {
    if b.len() < FIXED_LEN {
        return Err(BadLockId);
    }
    let field = |at: std::ops::Range<usize>| &b[at];
    let (shard, rest) = take_short(&b[FIXED_LEN - 1..])?;
    let id = LockId {
        shard: shard.into(),
        epoch: u16::from_be_bytes(field(1..3).try_into().map_err(|_| BadLockId)?),
        ttl_secs: u32::from_be_bytes(field(3..7).try_into().map_err(|_| BadLockId)?),
        lease: i64::from_be_bytes(field(7..15).try_into().map_err(|_| BadLockId)?),
        revision: i64::from_be_bytes(field(15..23).try_into().map_err(|_| BadLockId)?),
        name_hash: field(23..39).try_into().map_err(|_| BadLockId)?,
        owner: CompactString::default(),
    };
    if id.shard.is_empty() {
        return Err(BadLockId);
    }
    id.token().ok_or(BadLockId)?;
    Ok((id, rest))
}

/// One key lockIds are sealed with.
#[derive(Clone)]
struct SealKey {
    /// Named in every lockId it seals, so verification needs no search.
    id: String,
    /// Keyed once; cloned per use (a clone skips re-hashing the key).
    mac: Hmac<Sha256>,
}

/// What a lockId was opened with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seal<'a> {
    /// Sealed with the key of this id.
    Key(&'a str),
    /// A checksummed lockId, accepted while `accept_unsigned` is on.
    Unsigned,
}

/// Issues and opens lockIds under the configured keys: the first key seals,
/// every key opens (so keys can be rotated, see docs/security.md). Without
/// keys, lockIds are checksummed only.
#[derive(Clone)]
pub struct Sealer {
    keys: Vec<SealKey>,
    /// Also open checksummed lockIds (while turning sealing on).
    accept_unsigned: bool,
}

/// Why a set of keys cannot seal lockIds.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BadKeys {
    #[error("lockId key id {0:?} must be 1 to 16 characters of [A-Za-z0-9_-]")]
    Id(String),
    #[error("lockId key {0:?} must be at least 32 bytes")]
    Short(String),
    #[error("lockId key id {0:?} is used twice")]
    Duplicate(String),
}

impl Sealer {
    /// Checksummed lockIds only (no keys configured).
    pub fn unsigned() -> Self {
        Self {
            keys: Vec::new(),
            accept_unsigned: true,
        }
    }

    /// Seals with the first of `keys` (id, secret); opens with any. With no
    /// keys, the same as [`Sealer::unsigned`].
    pub fn new(keys: &[(String, Vec<u8>)], accept_unsigned: bool) -> Result<Self, BadKeys> {
        let mut sealed: Vec<SealKey> = Vec::with_capacity(keys.len());
        for (id, secret) in keys {
            if id.is_empty()
                || id.len() > 16
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(BadKeys::Id(id.clone()));
            }
            if secret.len() < 32 {
                return Err(BadKeys::Short(id.clone()));
            }
            if sealed.iter().any(|k| k.id == *id) {
                return Err(BadKeys::Duplicate(id.clone()));
            }
            let mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
            sealed.push(SealKey {
                id: id.clone(),
                mac,
            });
        }
        Ok(Self {
            accept_unsigned: accept_unsigned || sealed.is_empty(),
            keys: sealed,
        })
    }

    /// Whether lockIds are sealed (keys are configured).
    pub fn seals(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The lockId of `id`: sealed under the first key, or checksummed.
    pub fn seal(&self, id: &LockId) -> String {
        let Some(key) = self.keys.first() else {
            return id.encode();
        };
        let mut b = id.fixed(SEALED);
        push_short(&mut b, &id.owner);
        push_short(&mut b, &key.id);
        let mut mac = key.mac.clone();
        mac.update(&b);
        b.extend_from_slice(&mac.finalize().into_bytes()[..MAC_LEN]);
        URL_SAFE_NO_PAD.encode(b)
    }

    /// Opens a lockId this deployment issued, naming the key that sealed it.
    pub fn open<'a>(&'a self, s: &str) -> Result<(LockId, Seal<'a>), BadLockId> {
        let mut buf = [0; MAX_RAW];
        let b = raw(s, &mut buf)?;
        match b.first() {
            Some(&SEALED) => self.open_sealed(b),
            Some(&CHECKSUMMED) if self.accept_unsigned => {
                Ok((LockId::decode_raw(b)?, Seal::Unsigned))
            }
            _ => Err(BadLockId),
        }
    }

    fn open_sealed<'a>(&'a self, b: &[u8]) -> Result<(LockId, Seal<'a>), BadLockId> {
        if b.len() < FIXED_LEN + MAC_LEN {
            return Err(BadLockId);
        }
        let (body, tag) = b.split_at(b.len() - MAC_LEN);
        let (mut id, rest) = parse_fixed(body)?;
        let (owner, rest) = take_short(rest)?;
        let (key_id, rest) = take_short(rest)?;
        if !rest.is_empty() {
            return Err(BadLockId);
        }
        let key = self.keys.iter().find(|k| k.id == key_id).ok_or(BadLockId)?;
        let mut mac = key.mac.clone();
        mac.update(body);
        // Constant time: a forger learns nothing from how long it took.
        mac.verify_truncated_left(tag).map_err(|_| BadLockId)?;
        id.owner = owner.into();
        Ok((id, Seal::Key(&key.id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LockId {
        LockId {
            shard: "shard-b".into(),
            epoch: 3,
            ttl_secs: 30,
            lease: 0x1234_5678_9abc,
            revision: 4711,
            name_hash: crate::shard::keys::name_hash("process_order:42"),
            owner: Default::default(),
        }
    }

    fn owned() -> LockId {
        LockId {
            owner: "payments".into(),
            ..sample()
        }
    }

    fn key(id: &str, byte: u8) -> (String, Vec<u8>) {
        (id.to_string(), vec![byte; 32])
    }

    fn url_safe(s: &str) -> bool {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }

    #[test]
    fn round_trips_and_is_url_safe() {
        let s = sample().encode();
        assert!(url_safe(&s));
        assert!(s.len() <= MAX_LEN);
        assert_eq!(LockId::decode(&s).unwrap(), sample());
    }

    #[test]
    fn any_altered_character_is_rejected() {
        let s = sample().encode();
        for i in 0..s.len() {
            let mut chars: Vec<char> = s.chars().collect();
            chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
            let altered: String = chars.into_iter().collect();
            // The last character may carry only padding bits, which base64
            // decoders may ignore; everything else must be caught.
            if let Ok(id) = LockId::decode(&altered) {
                assert_eq!(id, sample(), "altered id at {i} decoded differently");
            }
        }
        for bad in ["", "!!!", "AAAA", &"A".repeat(600), &s[..s.len() - 3]] {
            assert_eq!(LockId::decode(bad), Err(BadLockId), "{bad:?}");
        }
    }

    #[test]
    fn sealed_ids_round_trip_with_their_owner_and_key() {
        let sealer = Sealer::new(&[key("k2", 2), key("k1", 1)], false).unwrap();
        let s = sealer.seal(&owned());
        assert!(url_safe(&s));
        let longest = LockId {
            shard: "s".repeat(64).into(),
            owner: "o".repeat(64).into(),
            ..sample()
        };
        let long = Sealer::new(&[key(&"k".repeat(16), 1)], false).unwrap();
        assert!(long.seal(&longest).len() <= MAX_LEN);
        assert_eq!(sealer.open(&s), Ok((owned(), Seal::Key("k2"))));
    }

    #[test]
    fn a_sealed_id_opens_under_any_configured_key_and_no_other() {
        let old = Sealer::new(&[key("k1", 1)], false).unwrap();
        let s = old.seal(&owned());
        // Rotation: k2 now seals, k1 still opens what it sealed.
        let rotated = Sealer::new(&[key("k2", 2), key("k1", 1)], false).unwrap();
        assert_eq!(rotated.open(&s), Ok((owned(), Seal::Key("k1"))));
        let retired = Sealer::new(&[key("k2", 2)], false).unwrap();
        assert_eq!(retired.open(&s), Err(BadLockId), "k1 retired");
        // The same id but another secret: another deployment's lockId.
        let other = Sealer::new(&[key("k1", 9)], false).unwrap();
        assert_eq!(other.open(&s), Err(BadLockId));
    }

    #[test]
    fn any_edit_of_a_sealed_id_is_refused() {
        let sealer = Sealer::new(&[key("k1", 1)], false).unwrap();
        let s = sealer.seal(&owned());
        for i in 0..s.len() - 1 {
            let mut chars: Vec<char> = s.chars().collect();
            chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
            let altered: String = chars.into_iter().collect();
            assert_eq!(sealer.open(&altered), Err(BadLockId), "edit at {i}");
        }
        // Re-sealing another owner, epoch or lease needs the key.
        for edit in [
            LockId {
                owner: "billing".into(),
                ..owned()
            },
            LockId {
                epoch: 4,
                ..owned()
            },
        ] {
            let mut forged = edit.fixed(SEALED);
            push_short(&mut forged, &edit.owner);
            push_short(&mut forged, "k1");
            forged.extend_from_slice(&[0u8; MAC_LEN]);
            assert_eq!(sealer.open(&URL_SAFE_NO_PAD.encode(forged)), Err(BadLockId));
        }
    }

    #[test]
    fn checksummed_ids_open_only_while_accepted() {
        let unsigned = sample().encode();
        assert_eq!(
            Sealer::unsigned().open(&unsigned),
            Ok((sample(), Seal::Unsigned))
        );
        let strict = Sealer::new(&[key("k1", 1)], false).unwrap();
        assert_eq!(strict.open(&unsigned), Err(BadLockId));
        let lenient = Sealer::new(&[key("k1", 1)], true).unwrap();
        assert_eq!(lenient.open(&unsigned), Ok((sample(), Seal::Unsigned)));
        // Without keys nothing can be sealed: a sealed id is refused.
        let sealed = strict.seal(&owned());
        assert_eq!(Sealer::unsigned().open(&sealed), Err(BadLockId));
        assert_eq!(Sealer::unsigned().seal(&sample()), unsigned);
    }

    #[test]
    fn bad_keys_are_named() {
        assert_eq!(
            Sealer::new(&[("k 1".into(), vec![1; 32])], false).err(),
            Some(BadKeys::Id("k 1".into()))
        );
        assert_eq!(
            Sealer::new(&[("k1".into(), vec![1; 31])], false).err(),
            Some(BadKeys::Short("k1".into()))
        );
        assert_eq!(
            Sealer::new(&[key("k1", 1), key("k1", 2)], false).err(),
            Some(BadKeys::Duplicate("k1".into()))
        );
    }
}
